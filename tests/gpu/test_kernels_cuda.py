"""MegaGate and MegaMHC on a CUDA GPU: the Triton kernels on CUDA tensors, forward and backward,
against the pure-torch references on the same inputs on the CPU (tests/kernels/ hold them to
transformers' modules; this holds the GPU to the same numbers).

Run by scripts/gpu_check.sh on a lent GPU (docs/gpu.md); skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from hyperparallel.kernels import mega_gate, mega_mhc
from tests.gpu.helpers import CUDA, leaf_like, requires_cuda

pytestmark = requires_cuda

# ------------------------------------------------------------------------------------ MegaGate

GATE_CASES = {  # mega_gate options of each family (as tests/kernels/test_mega_gate.py)
    "softmax": dict(score="softmax", top_k=4),
    "sigmoid_groups": dict(score="sigmoid", top_k=8, num_groups=8, top_groups=4, routed_scaling_factor=2.5,
                           norm_eps=1e-20),
    "sqrtsoftplus": dict(score="sqrtsoftplus", top_k=6, routed_scaling_factor=1.5, norm_eps=1e-20),
    "hash": dict(score="sqrtsoftplus", top_k=4, routed_scaling_factor=1.5, norm_eps=1e-20),
}
# fp32 on both sides; exp / log1p / sqrt of the GPU and the CPU differ by an ulp or two, and the
# per-expert sums over thousands of tokens are added in another order
GATE_ATOL = {"weights": 1e-5, "grad": 1e-5}
GATE_PROB_SUM_RTOL = 1e-5


def gate_inputs(case: str, tokens: int, num_experts: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=g)
    bias = None if case in ("softmax", "hash") else torch.randn(num_experts, generator=g) * 0.05
    hashed = None
    if case == "hash":
        hashed = torch.rand(tokens, num_experts, generator=g).topk(GATE_CASES[case]["top_k"], dim=-1).indices
    return logits, bias, hashed


def on(t, device):
    return None if t is None else t.to(device)


@pytest.mark.parametrize("case", GATE_CASES)
@pytest.mark.parametrize("tokens,num_experts", [(57, 32), (4096, 64), (1000, 256)])
def test_mega_gate_triton_matches_reference(case, tokens, num_experts):
    logits, bias, hashed = gate_inputs(case, tokens, num_experts, seed=tokens + num_experts)
    options = dict(GATE_CASES[case], aux_probs=True)
    a, b = leaf_like(logits, CUDA), leaf_like(logits, "cpu")
    w, i, counts, prob_sum = mega_gate.run_backend("triton", a, on(bias, CUDA), hash_indices=on(hashed, CUDA),
                                                   **options)
    rw, ri, rcounts, rprob_sum = mega_gate.run_backend("reference", b, bias, hash_indices=hashed, **options)
    assert w.device.type == CUDA.type
    assert torch.equal(i.cpu(), ri) and torch.equal(counts.cpu(), rcounts)
    torch.testing.assert_close(w.cpu(), rw, rtol=0, atol=GATE_ATOL["weights"])
    torch.testing.assert_close(prob_sum.cpu(), rprob_sum, rtol=GATE_PROB_SUM_RTOL, atol=1e-6)
    g = torch.Generator().manual_seed(tokens)
    gw, gs = torch.randn(w.shape, generator=g), torch.randn(prob_sum.shape, generator=g)
    ((w * gw.to(CUDA)).sum() + (prob_sum * gs.to(CUDA)).sum()).backward()
    ((rw * gw).sum() + (rprob_sum * gs).sum()).backward()
    torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=0, atol=GATE_ATOL["grad"])


def test_mega_gate_default_backend_on_cuda_is_triton():
    assert mega_gate.backend_for(torch.device("cuda")) == "triton"


# ------------------------------------------------------------------------------------ MegaMHC

ITERS = 20
MHC_OUT = dict(atol=1e-5, rtol=0)  # tests/kernels/test_mega_mhc.py's tolerances
MHC_GRAD = dict(atol=1e-4, rtol=1e-5)
# at 2048 tokens of width 1024 the gradients w.r.t. fn, base and scale are sums over 32x the
# terms of those cases, in another order on each side: their rounding grows with them
MHC_GRAD_LARGE = dict(atol=1e-3, rtol=1e-4)


def mhc_params(n: int, d: int, seed: int = 0):
    """fn, base, scale of a DeepSeek-V4 hyper-connection with n streams of width d (random)."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    torch.manual_seed(seed)
    hc = DeepseekV4HyperConnection(DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=ITERS))
    with torch.no_grad():
        hc.fn.normal_(0.0, 0.1)
        hc.base.normal_(0.0, 0.5)
        hc.scale.copy_(torch.tensor([0.7, 1.3, 0.9]))
    return [p.detach() for p in (hc.fn, hc.base, hc.scale)], hc.hc_eps, hc.input_norm.eps


def grads(outputs, cotangents, wrt):
    loss = sum((o.float() * c.to(o.device).float()).sum() for o, c in zip(outputs, cotangents, strict=True))
    return torch.autograd.grad(loss, wrt)


def assert_all_close(got, want, tol, what):
    for k, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{what}[{k}]"
        torch.testing.assert_close(g.detach().cpu(), w.detach(), **tol, msg=lambda m, k=k: f"{what}[{k}]: {m}")


@pytest.mark.parametrize("tokens,n,d", [(64, 4, 64), (2048, 4, 1024)])
def test_mega_mhc_pre_and_post_triton_match_reference(tokens, n, d):
    params, hc_eps, norm_eps = mhc_params(n, d)
    torch.manual_seed(1)
    x = torch.randn(tokens, n, d)
    block_out = torch.randn(tokens, d)
    cot_pre = (torch.randn(tokens, n), torch.randn(tokens, n, n), torch.randn(tokens, d))
    cot_post = (torch.randn(tokens, n, d),)
    results = {}
    for backend, device in (("triton", CUDA), ("reference", torch.device("cpu"))):
        xs, ps, bo = leaf_like(x, device), [leaf_like(p, device) for p in params], leaf_like(block_out, device)
        pre = mega_mhc.run_pre(backend, xs, *ps, sinkhorn_iters=ITERS, hc_eps=hc_eps, norm_eps=norm_eps)
        pre_grads = grads(pre, cot_pre, [xs, *ps])
        post, comb = (t.detach().requires_grad_() for t in pre[:2])
        mixed = (mega_mhc.run_post(backend, bo, xs, post, comb),)
        post_grads = grads(mixed, cot_post, [bo, xs, post, comb])
        results[backend] = (pre, pre_grads, mixed, post_grads)
    (pre, pre_g, mixed, post_g), (rpre, rpre_g, rmixed, rpost_g) = results["triton"], results["reference"]
    assert pre[0].device.type == CUDA.type
    assert_all_close(pre, rpre, MHC_OUT, "pre")
    grad_tol = MHC_GRAD if tokens <= 64 else MHC_GRAD_LARGE
    assert_all_close(pre_g, rpre_g, grad_tol, "pre grads")
    assert_all_close(mixed, rmixed, MHC_OUT, "post")
    assert_all_close(post_g, rpost_g, grad_tol, "post grads")


def test_mega_mhc_head_triton_matches_reference():
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    torch.manual_seed(0)
    head = DeepseekV4HyperHead(DeepseekV4Config(hidden_size=256, hc_mult=4, hc_sinkhorn_iters=ITERS))
    with torch.no_grad():
        head.hc_fn.normal_(0.0, 0.1)
        head.hc_base.normal_(0.0, 0.5)
        head.hc_scale.fill_(0.8)
    params = [p.detach() for p in (head.hc_fn, head.hc_base, head.hc_scale)]
    x = torch.randn(512, 4, 256)
    cot = (torch.randn(512, 256),)
    out = {}
    for backend, device in (("triton", CUDA), ("reference", torch.device("cpu"))):
        xs, ps = leaf_like(x, device), [leaf_like(p, device) for p in params]
        y = (mega_mhc.run_head(backend, xs, *ps, hc_eps=head.eps, norm_eps=head.input_norm.eps),)
        out[backend] = (y, grads(y, cot, [xs, *ps]))
    assert_all_close(out["triton"][0], out["reference"][0], MHC_OUT, "head")
    assert_all_close(out["triton"][1], out["reference"][1], MHC_GRAD, "head grads")
