"""kernels.use_isa: one instruction-set level for every native library (csrc/hp_isa.h), and the
fused kernels' results at each level the processor has (the MX and DVM kernels are held to
their references at every level in tests/mx/test_cpu_backend.py and tests/fusion/test_vm.py)."""

from __future__ import annotations

import pytest
import torch

import hyperparallel.fusion.vm  # noqa: F401 (loads the DVM's library)
import hyperparallel.mx.backends.native  # noqa: F401 (loads the MX library)
from hyperparallel.errors import ConfigError
from hyperparallel.kernels import LEVELS, instruction_set, isa, use_isa
from hyperparallel.kernels import mega_gate as mg
from hyperparallel.kernels import mega_mhc as mhc

BEST = use_isa("avx512")  # the processor's best level
HAVE = LEVELS[: LEVELS.index(BEST) + 1]


@pytest.fixture
def restore_best():
    yield
    assert use_isa("avx512") == BEST


def test_every_library_runs_at_the_level_asked_for(restore_best):
    assert len(instruction_set._LIBRARIES) == 4  # mx, dvm, mega_gate, mega_mhc (all built by make setup)
    for level in HAVE:
        assert use_isa(level) == level == isa()
        assert {get().decode() for _, get in instruction_set._LIBRARIES.values()} == {level}
    assert use_isa(len(LEVELS) + 5) == BEST  # above the processor's best: its best


def test_a_library_loaded_later_follows_the_choice(restore_best):
    use_isa("generic")
    asked = []
    instruction_set.register("hyperparallel._late_native", lambda level: asked.append(level) or b"generic",
                             lambda: b"generic")
    try:
        assert asked == [0]
    finally:
        del instruction_set._LIBRARIES["hyperparallel._late_native"]


def test_an_unknown_level_is_refused():
    with pytest.raises(ConfigError, match="'sse9' is not one of generic, avx2, avx512"):
        use_isa("sse9")


@pytest.mark.skipif(mg.native.LIB is None, reason="native library not built")
@pytest.mark.parametrize("score", mg.SCORES)
def test_mega_gate_at_every_level(restore_best, score):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(300, 64, generator=g).requires_grad_()
    bias = 0.01 * torch.randn(64, generator=g)
    cotangent = torch.randn(300, 6, generator=g)
    results = {}
    for level in HAVE:
        use_isa(level)
        weights, indices, counts, prob_sum = mg.run_backend("native", logits, bias, score=score, top_k=6,
                                                            num_groups=4, top_groups=2, aux_probs=True)
        (grad,) = torch.autograd.grad((weights * cotangent).sum() + prob_sum.sum(), logits)
        results[level] = (weights, indices, counts, prob_sum, grad)
    best_weights, best_indices, best_counts, best_sums, best_grad = results[BEST]
    for weights, indices, counts, prob_sum, grad in results.values():
        assert torch.equal(indices, best_indices) and torch.equal(counts, best_counts)  # the same experts
        for got, want in ((weights, best_weights), (prob_sum, best_sums), (grad, best_grad)):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)  # only sums' order follows the width


@pytest.mark.skipif(mhc.native.LIB is None, reason="native library not built")
def test_mega_mhc_at_every_level(restore_best):
    g = torch.Generator().manual_seed(1)
    T, N, D = 40, 4, 96
    streams = torch.randn(T, N, D, generator=g).requires_grad_()
    fn = (0.02 * torch.randn((2 + N) * N, N * D, generator=g)).requires_grad_()
    base, scale = 0.1 * torch.randn((2 + N) * N, generator=g), 1 + 0.1 * torch.randn(3, generator=g)
    block, cotangent = torch.randn(T, D, generator=g), torch.randn(T, N, D, generator=g)
    results = {}
    for level in HAVE:
        use_isa(level)
        post, comb, collapsed = mhc.run_pre("native", streams, fn, base, scale, sinkhorn_iters=20, hc_eps=1e-6,
                                            norm_eps=1e-6)
        out = mhc.run_post("native", torch.tanh(collapsed) + block, streams, post, comb)
        results[level] = (out, *torch.autograd.grad((out * cotangent).sum(), [streams, fn]))
    for level, got in results.items():
        for a, b in zip(got, results[BEST], strict=True):
            if level == "generic":  # no fused multiply-adds: rounded otherwise (measured 3e-5 on grad_fn ~ 140)
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
            else:  # x86-64-v3 and v4: the same bits
                assert torch.equal(a, b)
