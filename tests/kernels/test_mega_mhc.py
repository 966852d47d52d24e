"""MegaMHC against transformers' own DeepSeek-V4 hyper-connection modules.

DeepseekV4HyperConnection, DeepseekV4HyperHead and the expand-and-mix of
DeepseekV4DecoderLayer.forward are the reference: values and gradients (w.r.t. the streams, the
block output, fn, base, scale, post and comb, through random cotangents) of the native kernels,
the Triton kernels (run by the Triton interpreter on CPU) and the pure-torch reference. Then
torch.compile, what backward keeps, the modules, and the errors a caller can make.

The Triton cases run on Triton's interpreter (tests/triton_interpreter.py), set only while they run.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

with imports():
    import torch
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection, DeepseekV4HyperHead

    from hyperparallel.errors import ConfigError, ShapeError
    from hyperparallel.kernels import mega_mhc
    from hyperparallel.kernels.mega_mhc import MegaHyperConnection, MegaHyperHead
    from hyperparallel.kernels.mega_mhc.modules import hf_norm_eps
    from hyperparallel.kernels.triton_support import triton

T, N, D = 64, 4, 64
ITERS = 20
HAS_NATIVE = mega_mhc.native.LIB is not None
HAS_TRITON = triton is not None

BACKENDS = [
    pytest.param("native", marks=pytest.mark.skipif(not HAS_NATIVE, reason="native library not built")),
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
    "reference",
]
FUSED = BACKENDS[:2]

# Measured max |difference| on these cases, fp32, any backend: outputs 1e-6, gradients 2e-5
# (those w.r.t. fn, base and scale are sums over the 64 tokens, of magnitude 20-40).
OUT_TOL = dict(atol=1e-5, rtol=0)
GRAD_TOL = dict(atol=1e-4, rtol=1e-5)


@pytest.fixture(autouse=True)
def _interpret(request):
    if "triton" in request.node.name:
        request.getfixturevalue("triton_interpreter")


def config(**overrides) -> DeepseekV4Config:
    # what the hyper-connection modules read: hc_mult, hidden_size, hc_sinkhorn_iters, hc_eps, rms_norm_eps
    return DeepseekV4Config(hidden_size=D, hc_mult=N, hc_sinkhorn_iters=ITERS, **overrides)


def hf_connection(seed: int = 0) -> DeepseekV4HyperConnection:
    """Random fp32 parameters: nonzero base, scales not 1."""
    torch.manual_seed(seed)
    hc = DeepseekV4HyperConnection(config())
    with torch.no_grad():
        hc.fn.normal_(0.0, 0.1)
        hc.base.normal_(0.0, 0.5)
        hc.scale.copy_(torch.tensor([0.7, 1.3, 0.9]))
    return hc


def hf_head(seed: int = 0) -> DeepseekV4HyperHead:
    torch.manual_seed(seed)
    head = DeepseekV4HyperHead(config())
    with torch.no_grad():
        head.hc_fn.normal_(0.0, 0.1)
        head.hc_base.normal_(0.0, 0.5)
        head.hc_scale.fill_(0.8)
    return head


def hf_mix(block_out, streams, post, comb):
    """DeepseekV4DecoderLayer.forward's expand-and-mix, as written there."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams)


def leaf(*shape, dtype=torch.float32, seed=1):
    torch.manual_seed(seed)
    return torch.randn(*shape).to(dtype).requires_grad_()


def grads_of(outputs, cotangents, wrt):
    loss = sum((o.float() * c.float()).sum() for o, c in zip(outputs, cotangents, strict=True))
    return torch.autograd.grad(loss, wrt)


def assert_close(got, expected, tol):
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, **tol)


def max_diff(got, expected) -> float:
    return max((g.float() - e.float()).abs().max().item() for g, e in zip(got, expected, strict=True))


# -------------------------------------------------------------------------- against transformers


@pytest.mark.parametrize("backend", BACKENDS)
def test_pre_matches_transformers(backend):
    hc = hf_connection()
    params = list(hc.parameters())  # fn, base, scale
    x = leaf(T, N, D)
    cot = (torch.randn(T, N), torch.randn(T, N, N), torch.randn(T, D))
    ref = [t.squeeze(0) for t in hc(x.unsqueeze(0))]
    got = mega_mhc.run_pre(backend, x, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS, hc_eps=hc.hc_eps,
                           norm_eps=hf_norm_eps(hc.input_norm))
    assert_close(got, ref, OUT_TOL)
    assert_close(grads_of(got, cot, [x, *params]), grads_of(ref, cot, [x, *params]), GRAD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_pre_takes_expanded_gradients(backend):
    """sum()'s gradients are expanded views (stride 0): the kernels get contiguous copies."""
    hc = hf_connection()
    x = leaf(T, N, D)

    def grads(outputs):
        post, comb, collapsed = outputs
        return torch.autograd.grad(post.sum() + 0.5 * comb.sum() + collapsed.sum(), [x, *hc.parameters()])

    ref = grads([t.squeeze(0) for t in hc(x.unsqueeze(0))])
    got = grads(mega_mhc.run_pre(backend, x, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS, hc_eps=hc.hc_eps,
                                 norm_eps=hf_norm_eps(hc.input_norm)))
    assert_close(got, ref, GRAD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_post_matches_decoder_mixing(backend):
    x, block_out = leaf(T, N, D, seed=1), leaf(T, D, seed=2)
    post = (torch.rand(T, N) * 2).requires_grad_()
    comb = torch.rand(T, N, N).requires_grad_()
    cot = (torch.randn(T, N, D),)
    wrt = [block_out, x, post, comb]
    ref = (hf_mix(block_out, x, post, comb),)
    got = (mega_mhc.run_post(backend, block_out, x, post, comb),)
    assert_close(got, ref, OUT_TOL)
    assert_close(grads_of(got, cot, wrt), grads_of(ref, cot, wrt), GRAD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_matches_transformers(backend):
    head = hf_head()
    x = leaf(T, N, D)
    cot = (torch.randn(T, D),)
    wrt = [x, *head.parameters()]
    ref = (head(x.unsqueeze(0)).squeeze(0),)
    got = (mega_mhc.run_head(backend, x, head.hc_fn, head.hc_base, head.hc_scale, hc_eps=head.eps,
                             norm_eps=hf_norm_eps(head.input_norm)),)
    assert_close(got, ref, OUT_TOL)
    assert_close(grads_of(got, cot, wrt), grads_of(ref, cot, wrt), GRAD_TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_step_matches_transformers(backend):
    """Both operations as a decoder layer runs them (the block: a function of collapsed), so the
    gradient w.r.t. the streams adds the collapse's, the weights' and the mix's paths."""
    hc = hf_connection()
    x = leaf(T, N, D)
    cot = (torch.randn(T, N, D),)
    wrt = [x, *hc.parameters()]

    def step(pre, mix):
        post, comb, collapsed = pre(x)
        return (mix(torch.tanh(collapsed), x, post, comb),)

    ref = step(lambda s: [t.squeeze(0) for t in hc(s.unsqueeze(0))], hf_mix)
    got = step(lambda s: mega_mhc.run_pre(backend, s, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS,
                                          hc_eps=hc.hc_eps, norm_eps=hf_norm_eps(hc.input_norm)),
               lambda *a: mega_mhc.run_post(backend, *a))
    assert_close(got, ref, OUT_TOL)
    assert_close(grads_of(got, cot, wrt), grads_of(ref, cot, wrt), GRAD_TOL)


# ------------------------------------------------------------------------------------- bfloat16
# transformers mixes bf16 streams in bf16 (post and comb rounded first); MegaMHC computes in fp32
# and rounds once. Both against the fp32 computation on the same (bf16-exact) inputs.


def ulps(got: torch.Tensor, exact: torch.Tensor) -> float:
    """The largest |got - exact| in bf16 ulps of exact (2^-7 of its power of two), those of 1/16
    for smaller values: where the terms of a sum of size 1 cancel, fp32 rounding alone is a
    noticeable part of a bf16 ulp of the result."""
    ulp = torch.exp2(torch.floor(torch.log2(exact.detach().abs().clamp(min=2.0 ** -4))) - 7)
    return ((got.float() - exact) / ulp).abs().max().item()


@pytest.mark.parametrize("backend", FUSED)
def test_bf16_streams_within_rounding(backend):
    hc = hf_connection()
    x16, bo16 = leaf(T, N, D, dtype=torch.bfloat16), leaf(T, D, dtype=torch.bfloat16, seed=2)
    x32, bo32 = (t.detach().float().requires_grad_() for t in (x16, bo16))
    post, comb, collapsed = mega_mhc.run_pre(backend, x16, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS,
                                             hc_eps=hc.hc_eps, norm_eps=hf_norm_eps(hc.input_norm))
    exact = [t.squeeze(0) for t in hc(x32.unsqueeze(0))]
    theirs = [t.squeeze(0) for t in hc(x16.unsqueeze(0))]
    assert collapsed.dtype == theirs[2].dtype == torch.bfloat16
    assert_close((post, comb), exact[:2], OUT_TOL)  # the same bf16-exact values in: fp32 agreement
    # collapsed: rounded once from fp32 (measured 0.5 ulp), as transformers does (the same)
    assert ulps(collapsed, exact[2]) <= 0.51
    # the mix, with the same post and comb: rounded once here (measured 0.5 ulp); transformers
    # rounds post and comb to bf16 and mixes in bf16 (measured 22 ulps)
    p, c = exact[0].detach(), exact[1].detach()
    mixed = mega_mhc.run_post(backend, bo16, x16, p, c)
    mixed_exact = hf_mix(bo32, x32, p, c)
    assert mixed.dtype == torch.bfloat16
    assert ulps(mixed, mixed_exact) <= 0.51 < 10 < ulps(hf_mix(bo16, x16, p, c), mixed_exact)
    # gradients, with bf16 cotangents: those of the fp32 computation to bf16 rounding
    # (measured 5e-3 of the largest for the streams and block_out, 1e-6 for the parameters;
    # transformers' own bf16 run: 5e-3 and 1e-3)
    cot = (torch.randn(T, N), torch.randn(T, N, N), torch.randn(T, D).bfloat16(), torch.randn(T, N, D).bfloat16())
    wrt16, wrt32 = [x16, bo16, *hc.parameters()], [x32, bo32, *hc.parameters()]
    got = grads_of((post, comb, collapsed, mega_mhc.run_post(backend, bo16, x16, post, comb)), cot, wrt16)
    want = grads_of((*exact, hf_mix(bo32, x32, exact[0], exact[1])), cot, wrt32)
    for g, w, tol in zip(got, want, (2e-2, 2e-2, 1e-5, 1e-5, 1e-5), strict=True):
        assert (g.float() - w).abs().max().item() <= tol * w.abs().max().item()


def test_float16_runs_the_reference_on_cpu():
    hc = hf_connection()
    x = leaf(T, N, D, dtype=torch.float16)
    assert mega_mhc.backend_for(x) == "reference"
    assert mega_mhc.backend_for(x.float()) == ("native" if HAS_NATIVE else "reference")
    got = mega_mhc.mhc_pre(x, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS, hc_eps=hc.hc_eps,
                           norm_eps=hf_norm_eps(hc.input_norm))
    for g, w in zip(got, (t.squeeze(0) for t in hc(x.unsqueeze(0))), strict=True):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=0, atol=0)


# ----------------------------------------------------------------------------------- compile


def test_compile_fullgraph_same_values_and_ops():
    hc = hf_connection()
    x = leaf(T, N, D)
    params = list(hc.parameters())
    cot = torch.randn(T, N, D)

    def step(streams, fn, base, scale):
        post, comb, collapsed = mega_mhc.mhc_pre(streams, fn, base, scale, sinkhorn_iters=ITERS, hc_eps=1e-6,
                                                 norm_eps=1e-6)
        return mega_mhc.mhc_post(torch.tanh(collapsed), streams, post, comb)

    graphs = []

    def record(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=record, bw_compiler=record))
    eager_out = step(x, *params)
    out = compiled(x, *params)
    torch.testing.assert_close(out, eager_out, rtol=0, atol=0)
    eager_grads = torch.autograd.grad((eager_out * cot).sum(), [x, *params])
    torch.testing.assert_close(torch.autograd.grad((out * cot).sum(), [x, *params]), eager_grads, rtol=0, atol=0)
    backend = "cpu" if HAS_NATIVE else None
    if backend is None:
        pytest.skip("the reference path has no custom ops to find")
    targets = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    for op in ("pre", "post", "pre_backward", "post_backward"):
        assert f"hyperparallel.mega_mhc_{op}_{backend}.default" in targets


# ------------------------------------------------------------------------------ what backward keeps


def saved_bytes(run, inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward while `run()` runs, the
    storages of `inputs` (the streams, the block output, the parameters) left out."""
    storages: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    excluded = {t.untyped_storage().data_ptr() for t in inputs}
    return sum(nbytes for ptr, nbytes in storages.items() if ptr not in excluded)


@pytest.mark.skipif(not HAS_NATIVE, reason="native library not built")
def test_saved_bytes_far_below_transformers():
    Ts, Ds = 256, 256
    cfg = DeepseekV4Config(hidden_size=Ds, hc_mult=N, hc_sinkhorn_iters=ITERS)
    hc = DeepseekV4HyperConnection(cfg)
    with torch.no_grad():
        hc.fn.normal_(0.0, 0.1)
        hc.base.zero_()
        hc.scale.fill_(1.0)
    x, block_out = leaf(Ts, N, Ds), leaf(Ts, Ds, seed=2)
    inputs = [x, block_out, *hc.parameters()]

    def theirs():
        post, comb, collapsed = (t.squeeze(0) for t in hc(x.unsqueeze(0)))
        return hf_mix(block_out, x, post, comb), collapsed

    def ours():
        post, comb, collapsed = mega_mhc.mhc_pre(x, hc.fn, hc.base, hc.scale, sinkhorn_iters=ITERS,
                                                 hc_eps=hc.hc_eps, norm_eps=hf_norm_eps(hc.input_norm))
        return mega_mhc.mhc_post(block_out, x, post, comb), collapsed

    ratio = saved_bytes(ours, inputs) / saved_bytes(theirs, inputs)
    # measured 0.024: z [T, 24] and r [T] (pre), post and comb (post) against transformers' fp32
    # normalized streams [T, N D] and every Sinkhorn iterate
    assert ratio < 0.03


# ------------------------------------------------------------------------------------ modules


def test_connection_from_hf_takes_over_parameters():
    hc = hf_connection()
    mega = MegaHyperConnection.from_hf(hc)
    assert all(a is b for a, b in zip(mega.parameters(), hc.parameters(), strict=True))
    assert mega.state_dict().keys() == {"fn", "base", "scale"}
    streams = leaf(2, T // 2, N, D)
    for got, want in zip(mega(streams), hc(streams), strict=True):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **OUT_TOL)


def test_head_from_hf_takes_over_parameters():
    head = hf_head()
    mega = MegaHyperHead.from_hf(head)
    assert all(a is b for a, b in zip(mega.parameters(), head.parameters(), strict=True))
    assert mega.state_dict().keys() == {"hc_fn", "hc_base", "hc_scale"}
    streams = leaf(2, T // 2, N, D)
    torch.testing.assert_close(mega(streams), head(streams), **OUT_TOL)


def test_from_hf_on_meta_and_reset_parameters():
    with torch.device("meta"):
        hc, head = DeepseekV4HyperConnection(config()), DeepseekV4HyperHead(config())
    mega, mega_head = MegaHyperConnection.from_hf(hc), MegaHyperHead.from_hf(head)
    assert mega.fn is hc.fn and mega.fn.is_meta and mega_head.hc_fn is head.hc_fn
    assert (mega.sinkhorn_iters, mega.hc_eps, mega.norm_eps) == (ITERS, hc.hc_eps, hf_norm_eps(hc.input_norm))
    mega.to_empty(device="cpu")
    mega_head.to_empty(device="cpu")
    torch.manual_seed(3)
    mega.reset_parameters(std=0.5)
    mega_head.reset_parameters(std=0.5)
    assert 0.4 < mega.fn.std().item() < 0.6 and 0.3 < mega_head.hc_fn.std().item() < 0.7
    assert torch.equal(mega.base, torch.zeros_like(mega.base)) and torch.equal(mega.scale, torch.ones(3))
    assert torch.equal(mega_head.hc_base, torch.zeros(N)) and torch.equal(mega_head.hc_scale, torch.ones(1))


# ------------------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    hc = hf_connection()
    x = torch.randn(T, N, D)
    kw = dict(sinkhorn_iters=ITERS, hc_eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ShapeError, match="fn"):
        mega_mhc.mhc_pre(x, hc.fn[:, :-1], hc.base, hc.scale, **kw)
    with pytest.raises(ShapeError, match="scale"):
        mega_mhc.mhc_pre(x, hc.fn, hc.base, hc.scale[:2], **kw)
    with pytest.raises(ShapeError, match="streams"):
        mega_mhc.mhc_pre(x.view(T, N * D), hc.fn, hc.base, hc.scale, **kw)
    with pytest.raises(ShapeError, match="9 streams"):
        wide = torch.randn(2, 9, 4)
        mega_mhc.mhc_pre(wide, torch.zeros(99, 36), torch.zeros(99), torch.ones(3), **kw)
    with pytest.raises(ConfigError, match="sinkhorn_iters"):
        mega_mhc.mhc_pre(x, hc.fn, hc.base, hc.scale, sinkhorn_iters=0, hc_eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ShapeError, match="block_out"):
        mega_mhc.mhc_post(torch.randn(T, D + 1), x, torch.rand(T, N), torch.rand(T, N, N))
    with pytest.raises(ShapeError, match="comb"):
        mega_mhc.mhc_post(torch.randn(T, D), x, torch.rand(T, N), torch.rand(T, N, N + 1))
    with pytest.raises(ShapeError, match="hc_base"):
        mega_mhc.mhc_head(x, torch.randn(N, N * D), torch.randn(N + 1), torch.ones(1), hc_eps=1e-6, norm_eps=1e-6)
    with pytest.raises(ConfigError, match="backend"):
        mega_mhc.run_post("cuda-graphs", torch.randn(T, D), x, torch.rand(T, N), torch.rand(T, N, N))
