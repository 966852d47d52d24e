"""MXLinear and the MXFP8 experts run bf16 products and read nothing back to the host.

Counted with tests/host_reads.py's dispatch mode over one forward + backward on bf16 inputs, on
both MX backends a CUDA run can take: the CPU kernels and the Triton kernels (the code CUDA runs,
here under Triton's interpreter on CPU tensors). The one read left is the CPU's own: the experts'
groups padded to 32 rows for oneDNN's kernels (`moe/permutation.py`, `padded_slots`: the padded
length, once per layer); on CUDA the groups are not padded and it is not made.
"""

from __future__ import annotations

import pytest

from tests.host_reads import HostReads
from tests.triton_interpreter import imports, triton_interpreter  # noqa: F401 (a fixture)

with imports():
    import torch

    import hyperparallel.mx.backends as mx_backends
    from hyperparallel.lowp import LowPrecisionConfig, MXExpertsRecipe, MXLinear
    from hyperparallel.moe import GroupedExperts

BACKENDS = ["cpu", "triton"]
CPU_PADDING_READ = ("_local_scalar_dense", "moe/permutation.py")


@pytest.fixture
def backend(request, monkeypatch):
    """Every MX operation of the test on this backend (triton: interpreted, on CPU tensors)."""
    if request.param == "triton":
        request.getfixturevalue("triton_interpreter")
    monkeypatch.setattr(mx_backends, "_FORCED", request.param)
    return request.param


def forward_backward(module, *inputs):
    module(*inputs).float().square().sum().backward()


def counted(module, *inputs) -> HostReads:
    forward_backward(module, *inputs)  # the weights' MX copies are made once per version: count a later step
    with HostReads() as reads:
        forward_backward(module, *inputs)
    return reads


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
@pytest.mark.parametrize("bias", [False, True])
def test_mxlinear_runs_bf16_products_and_no_host_reads(backend, bias):
    torch.manual_seed(0)
    layer = MXLinear.from_linear(torch.nn.Linear(64, 96, bias=bias).bfloat16(), LowPrecisionConfig())
    x = torch.randn(40, 64, dtype=torch.bfloat16, requires_grad=True)
    reads = counted(layer, x)
    assert reads.sites() == {}
    assert reads.product_dtypes() == {torch.bfloat16}
    assert sum(reads.products.values()) == 3  # forward, input grad, weight grad


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_mxlinear_under_bf16_autocast_runs_bf16_products_on_fp32_inputs(backend):
    torch.manual_seed(0)
    layer = MXLinear.from_linear(torch.nn.Linear(64, 96), LowPrecisionConfig())
    x = torch.randn(40, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), HostReads() as reads:
        y = layer(x)
    y.float().sum().backward()
    assert y.dtype == torch.bfloat16  # as nn.Linear's under autocast
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32
    assert reads.sites() == {} and reads.product_dtypes() == {torch.bfloat16}


@pytest.mark.parametrize("backend", BACKENDS, indirect=True)
def test_mx_experts_run_bf16_products_and_read_only_the_cpus_padding(backend):
    torch.manual_seed(0)
    experts = GroupedExperts(4, 64, 96, torch.nn.SiLU(), dtype=torch.bfloat16)
    experts.reset_parameters()
    experts.recipe = MXExpertsRecipe(LowPrecisionConfig())
    hidden = torch.randn(48, 64, dtype=torch.bfloat16, requires_grad=True)
    top_k_index = torch.randint(0, 4, (48, 2))
    top_k_weights = torch.rand(48, 2, dtype=torch.bfloat16)
    reads = counted(experts, hidden, top_k_index, top_k_weights)
    assert [(op, site.split(":")[0]) for op, site in reads.sites()] == [CPU_PADDING_READ]
    assert reads.total() == 1
    assert reads.product_dtypes() == {torch.bfloat16}
    assert sum(reads.products.values()) == 6  # two projections x (forward, input grad, weight grad)


def test_the_count_sees_what_would_sync():
    # the reads the MX products made before they chose their dtype from dtypes alone
    t = torch.arange(64).reshape(8, 8)
    with HostReads() as reads:
        int(t.max()), bool((t > 3).any()), t[t > 60], torch.equal(t, t)
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch._assert_async(t.sum() > 0)  # on the device: no read
        t.cpu(), t.numpy(), t.tolist()  # no ATen operation on a CPU tensor: counted by name
    assert sorted(op for op, _ in reads.reads.elements()) == ["_local_scalar_dense", "_local_scalar_dense", "cpu",
                                                              "equal", "index", "numpy", "repeat_interleave",
                                                              "tolist"]
