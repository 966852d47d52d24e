"""MegaMHC: DeepSeek-V4's manifold-constrained hyper-connections as fused operations.

transformers' DeepseekV4HyperConnection turns a token's N residual streams [N, D] into three sets
of weights and the input of the next block: an unweighted RMSNorm of the flattened streams, a
projection by fn [(2 + N) N, N D], then pre = sigmoid(.) + eps, post = 2 sigmoid(.) and
comb = Sinkhorn-Knopp(softmax(.) + eps), and the collapse sum_n pre_n x_n. After the block its
decoder layer expands and mixes: out_k = post_k block_out + sum_j comb_jk x_j. Eager PyTorch runs
some 60 small operations for that, each keeping its inputs for backward. Here it is three fused
operations, each forward and backward:

  mhc_pre(streams, fn, base, scale, ...)   -> (post [T, N], comb [T, N, N], collapsed [T, D])
  mhc_post(block_out, streams, post, comb) -> the mixed streams [T, N, D]
  mhc_head(streams, hc_fn, hc_base, hc_scale, ...) -> collapsed [T, D] (DeepseekV4HyperHead)

and two modules that take over transformers' Parameters: MegaHyperConnection, MegaHyperHead.

Backends, chosen by the streams' device (kernels.backends' [Note: fused backends]): the native C
kernels on CPU tensors (csrc/mega_mhc.c, `native`; float32 and bfloat16; float16 and an unbuilt
library run the reference), Triton on CUDA tensors (`triton`), and the pure-torch references
(`reference`: `mhc_pre_reference`, ..., the specification in code) on any other device. The
native and Triton paths are `torch.library` custom ops with fake implementations and their
backward as custom ops too (`op`), so torch.compile traces them whole. The modules are in
`modules`; models.deepseek_v4 puts them into DeepSeek-V4's decoder layers.

[Note: the projection] rmsnorm-then-linear is (x . fn^T) r with r = rsqrt(mean(x^2) + eps): one
pass over a token's row gives both z = x . fn^T and the sum of squares. Backward, with
gz = (dL/da) r for a = z r, needs grad_x = gz . fn - (r^2 / K)(gz . z) x + the collapse's term,
and grad_fn = gz^T . x.

[Note: what backward keeps] mhc_pre keeps z [T, M] and r [T] (fp32, some 100 bytes a token) and
references to its inputs; the weights and all Sinkhorn iterates are recomputed per token in
backward, which differentiates exactly the finite iterations forward ran. mhc_post and mhc_head
keep only their inputs. transformers' modules keep several fp32 copies of the streams.

[Note: precision] Everything is computed in fp32 and rounded once to the output's dtype.
transformers computes the collapse in fp32 too, but the mix in the streams' dtype (post and comb
rounded to it first), so for bf16 streams the mix here is the more exact of the two; for fp32
they agree to fp32 rounding.
"""

from hyperparallel.kernels.backends import BACKENDS
from hyperparallel.kernels.mega_mhc.modules import MegaHyperConnection, MegaHyperHead
from hyperparallel.kernels.mega_mhc.native import MAX_STREAMS
from hyperparallel.kernels.mega_mhc.op import backend_for, mhc_head, mhc_post, mhc_pre, run_head, run_post, run_pre
from hyperparallel.kernels.mega_mhc.reference import mhc_head_reference, mhc_post_reference, mhc_pre_reference

__all__ = ["BACKENDS", "MAX_STREAMS", "MegaHyperConnection", "MegaHyperHead", "backend_for", "mhc_head",
           "mhc_head_reference", "mhc_post", "mhc_post_reference", "mhc_pre", "mhc_pre_reference", "run_head",
           "run_post", "run_pre"]
