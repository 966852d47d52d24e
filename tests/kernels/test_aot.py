"""Triton kernels compiled ahead of time to cubin for GPUs this machine does not have.

The whole command (every specialization of every kernel, sm_90 and sm_100: minutes of Triton's
compiler) runs in `.ci/run`; here: what the drivers record, one real kernel compiled for both
targets, and a broken kernel failing the command by name.
"""

from __future__ import annotations

import io

import pytest
import torch

from hyperparallel import mx
from hyperparallel.kernels import aot, triton_support
from hyperparallel.kernels.triton_support import JitKernels, tl, triton

pytestmark = pytest.mark.skipif(triton is None, reason="triton is not installed")

_KERNELS = JitKernels(globals())


@_KERNELS.register
def _broken_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.no_such_function(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _launch_broken():
    x = torch.zeros(16)
    _KERNELS.build()
    _broken_kernel[(1,)](x, x.numel(), BLOCK=16)


@_KERNELS.register
def _broken_helper(x):
    return tl.no_such_function(x)


@_KERNELS.register
def _kernel_calling_a_broken_helper(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, _broken_helper(tl.load(x_ptr + offs, mask=offs < n)), mask=offs < n)


def _launch_broken_helper():
    x = torch.zeros(16)
    _KERNELS.build()
    _kernel_calling_a_broken_helper[(1,)](x, x.numel(), BLOCK=16)


def _quantize_bf16_rows():
    mx.quantize(torch.zeros(64, 256, dtype=torch.bfloat16), -1, backend="triton")


@pytest.fixture(autouse=True)
def compiler_not_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def test_the_drivers_record_what_the_wrappers_launch():
    specs = aot.record(aot.DRIVERS.values())
    kernels = {s.kernel for s in specs}
    assert {"mx.backends.triton._quant_rows_kernel", "mx.backends.triton._dequant_kernel",
            "kernels.mega_gate.triton._forward_kernel", "kernels.mega_mhc.triton._post_kernel"} <= kernels
    rows = [dict(s.constexprs) for s in specs if s.name == "_quant_rows_kernel"]
    # every input dtype (fp32, bf16, fp16), both element formats, both scale modes
    assert {(r["IN_KIND"], r["EMAX"], r["RCEIL"]) for r in rows} == {(k, e, m) for k in (0, 1, 2) for e in (8, 15)
                                                                   for m in (False, True)}
    assert len(specs) == len(set(specs))  # each compiled once


def test_a_kernel_compiles_to_cubin_for_sm90_and_sm100():
    out = io.StringIO()
    assert aot.run("sm_90,sm_100", drivers=[_quantize_bf16_rows], out=out) == 0
    lines = out.getvalue().splitlines()
    assert [line.split("]")[-1].split(":")[0].strip() for line in lines[:-1]] == ["sm_90", "sm_100"]
    assert all(": ok" in line and "KiB" in line for line in lines[:-1])
    assert lines[-1].startswith("2 of 2 compiles ok (1 kernels, 1 specializations")


def test_a_broken_kernel_fails_the_command_by_name():
    out = io.StringIO()
    assert aot.run("sm_90,sm_100", drivers=[_quantize_bf16_rows, _launch_broken], quiet=True, out=out) == 2
    failed = [line for line in out.getvalue().splitlines() if "FAILED" in line]
    assert len(failed) == 2 and all("_broken_kernel" in line for line in failed), out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("2 of 4 compiles ok")


def test_an_error_in_a_called_jit_function_is_named_with_its_cause():
    out = io.StringIO()
    assert aot.run("sm_90", drivers=[_launch_broken_helper], quiet=True, out=out) == 1
    failed = out.getvalue().splitlines()[0]
    assert "_kernel_calling_a_broken_helper" in failed and "FAILED CompilationError in _broken_helper at " in failed
    assert failed.endswith("has no attribute 'no_such_function'\")"), failed


def test_a_bad_target_is_one_line(capsys):
    assert aot.main(["--targets", "sm_90,volta"]) == 2
    assert capsys.readouterr().err.strip() == "error: --targets: 'volta' is not a CUDA target such as sm_90 or sm_100"


def test_recording_runs_no_kernel_and_restores_the_jit():
    with triton_support.recorded_launches() as launches:
        _quantize_bf16_rows()
    assert [launch.name for launch in launches] == ["_quant_rows_kernel"]
    assert triton_support.unavailable_reason(torch.device("cpu")) is not None  # CPU tensors refused again
