"""MegaGate: everything a MoE router does after its logits, as one fused operation.

`mega_gate(logits, correction_bias, score=..., top_k=...)` computes, per token, what
`TopKRouter` (and transformers' routers, op for op) computes from the logits: the scores, the
biased and group-limited choice, the top k, the renormalized and scaled weights; and in the
same pass what load balancing reads, the per-expert loads and (``aux_probs``) the per-expert
sums of the auxiliary loss's distribution. Backward gives the gradient w.r.t. the logits from
the weights' and the probability sums' gradients.

Backends, chosen by the device of the logits (kernels.backends' [Note: fused backends]): the
native C kernel on CPU tensors (csrc/mega_gate.c, `native`, when built; else the reference),
Triton on CUDA tensors (`triton`), and `mega_gate_reference` (`reference`: pure torch, the
specification in code) on any other device. The native and Triton paths are `torch.library`
custom ops with fake implementations and their backward as a custom op too (`op`), so
torch.compile traces them whole (fullgraph) and AOTAutograd sees one forward and one backward
operation. moe's TopKRouter (`fused`) is where routers call it.

[Note: what backward keeps] Only the logits (the op's input, which the router's matmul keeps
anyway) and the int64 indices [T, k] are saved; backward recomputes each row's scores from its
logits. No [T, E] intermediate (scores, choice, masks) outlives the forward.

[Note: order of the k outputs] The k experts of a token come sorted by their choice value,
largest first, equal values by lower expert index (as a stable descending sort orders them).
Without ties that is torch.topk(sorted=True)'s order, and the experts are transformers' own;
transformers' DeepSeek routers ask for sorted=False, whose order is unspecified: the same set of
experts, with their weights, in some order. torch.topk leaves the order of equal values
unspecified (on CPU it is not by index: [20, 16, 1, 22] for four equal values), so where equal
values straddle the k-th place, which of them transformers takes is up to torch's selection
algorithm; MegaGate takes the lower indices, on every backend. The same rule picks among groups
of equal score. Hash-routed layers keep the table's order.
"""

from hyperparallel.kernels.backends import BACKENDS
from hyperparallel.kernels.mega_gate.op import backend_for, mega_gate, run_backend
from hyperparallel.kernels.mega_gate.reference import SCORES, mega_gate_reference

__all__ = ["BACKENDS", "SCORES", "backend_for", "mega_gate", "mega_gate_reference", "run_backend"]
