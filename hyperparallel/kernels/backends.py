"""The backend-choice and custom-op pattern every fused operation follows.

[Note: fused backends] A fused operation (MegaGate, MegaMHC) has three backends: "native" (its
C library, on CPU tensors), "triton" (CUDA tensors, or CPU tensors on Triton's interpreter) and
"reference" (pure torch, the specification in code, on any device and differentiable through
autograd). `FusedBackends.for_device` picks one for tensors of a device: native on the CPU when
its library is loaded (else the reference), Triton on CUDA when Triton can run, else the
reference. `FusedBackends.require` checks a backend asked for by name (tests and benchmarks run
each on the same inputs) and says why it cannot run. The native and Triton backends are the same
``torch.library`` custom ops, one set per backend (`custom_op`, names
``hyperparallel::<op>_<backend>``), each with a fake implementation and a backward that is a
custom op too, so torch.compile(fullgraph=True) traces them whole and AOTAutograd sees one forward
and one backward operation.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from hyperparallel.errors import ConfigError
from hyperparallel.kernels import native as _loader
from hyperparallel.kernels import triton_support

BACKENDS = ("native", "triton", "reference")


class FusedBackends:
    """The backends of one fused operation: `native_module` is its library's module (``LIB``, the
    loaded library or None, and ``MODULE``, the library's name), read when asked (a test may swap
    ``LIB``)."""

    def __init__(self, name: str, native_module: ModuleType):
        self.name = name
        self._native = native_module

    @property
    def native_loaded(self) -> bool:
        return self._native.LIB is not None

    def for_device(self, device: torch.device, *, native_takes: bool = True) -> str:
        """The backend tensors of `device` run on; `native_takes` False: the native kernels do not
        take these tensors (a dtype they lack), the CPU then runs the reference."""
        device = torch.device(device)
        if device.type == "cpu":
            return "native" if native_takes and self.native_loaded else "reference"
        if device.type == "cuda" and triton_support.unavailable_reason(device) is None:
            return "triton"
        return "reference"

    def require(self, backend: str, device: torch.device, where: str | None = None) -> None:
        """Raise ConfigError naming why `backend` cannot run `where` (default: this operation) on
        tensors of `device`."""
        where = where or self.name
        if backend not in BACKENDS:
            raise ConfigError(f"{where} backend {backend!r} is not one of {', '.join(BACKENDS)}")
        if backend == "native" and not self.native_loaded:
            raise ConfigError(f"{where} backend 'native': {_loader.unavailable_reason(self._native.MODULE)}")
        if backend == "triton" and (reason := triton_support.unavailable_reason(device)) is not None:
            raise ConfigError(f"{where} backend 'triton': {reason}")


def custom_op(name: str, impl: Callable, fake: Callable):
    """`impl` (annotated as torch.library infers a schema from) as the custom op
    ``hyperparallel::<name>``, with `fake` as its fake implementation; no input is mutated."""
    op = torch.library.custom_op(f"hyperparallel::{name}", mutates_args=())(impl)
    op.register_fake(fake)
    return op


def ptr(t: torch.Tensor | None) -> int | None:
    """A tensor's data pointer as a native kernel takes it (None: a NULL pointer)."""
    return None if t is None else t.data_ptr()


__all__ = ["BACKENDS", "FusedBackends", "custom_op", "ptr"]
