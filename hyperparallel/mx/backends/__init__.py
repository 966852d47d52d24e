"""Backends of the MX operators and how one is chosen.

A backend is a module with four functions (all tensors on its device):
    quantize(x, axis, elem_dtype, scale_mode) -> (data, scale)
    quantize_dual(x2d, elem_dtype, scale_mode) -> (row_data, row_scale, col_data, col_scale)
    quantize_grouped(x2d, offsets, elem_dtype, scale_mode) -> (data, scale)
    dequantize(data, scale, axis, group_offsets, dtype) -> tensor  (fp32, bf16, fp16; float64
        always goes to the reference, whose float64 holds every exact value)
Every backend matches ``hyperparallel.mx.reference`` byte for byte.

By default CPU tensors use "cpu" (native kernels; the reference where they were not built) and
CUDA tensors "triton". A caller forces one
with ``backend=...`` on any operator, or for the whole process with the environment variable
HYPERPARALLEL_MX_BACKEND (read when hyperparallel.mx is imported).
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from hyperparallel.errors import BackendError
from hyperparallel.kernels import native as native_libraries
from hyperparallel.mx import reference
from hyperparallel.mx.backends import cpu, triton
from hyperparallel.mx.backends import native as mx_native

BACKENDS = ("reference", "cpu", "triton")
# Imported up front (triton itself is imported lazily inside its backend) so that choosing a
# backend is plain Python that torch.compile can trace without a graph break.
_MODULES = {"reference": reference, "cpu": cpu, "triton": triton}
_FORCED = os.environ.get("HYPERPARALLEL_MX_BACKEND") or None


def get_backend(name: str | None, device: torch.device) -> ModuleType:
    name = name or _FORCED or _default_for(device)
    if name not in _MODULES:
        raise BackendError(f"MX backend {name!r} is unknown; choose one of {BACKENDS}")
    module = _MODULES[name]
    reason = module.unavailable_reason(device) if hasattr(module, "unavailable_reason") else None
    if reason:
        raise BackendError(f"MX backend {name!r} cannot run on {device}: {reason}")
    return module


def cpu_default(not_built: list[str]) -> str:
    """The native kernels; the reference where this install built none (a source install without a
    C compiler). A checkout's stale or broken build is not that: the cpu backend says why it cannot run."""
    return "reference" if mx_native.MODULE in not_built else "cpu"


_CPU_DEFAULT = cpu_default(native_libraries.not_built())


def _default_for(device: torch.device) -> str:
    if device.type == "cpu":
        return _CPU_DEFAULT
    if device.type == "cuda":
        return "triton"
    return "reference"
