"""What every Triton kernel module needs: the guarded import, the interpreter mode, why Triton
cannot run on a device, and kernels jitted on first use (again when the interpreter mode changes).

``triton`` is imported under a guard, so the package imports without it (``triton`` and ``tl``
are then None and `unavailable_reason` says why). [Note: kernels jitted on first use] A kernel
module writes its kernels as plain functions registered with a `JitKernels` and calls its
``build()`` before a launch: that turns every registered function into a triton.jit function in
the module's namespace, which is where Triton resolves calls between jit functions, and does it
again whenever TRITON_INTERPRET changed since. So TRITON_INTERPRET=1 (the kernels run by the
interpreter, on CPU tensors: how the tests run them) is honoured when it is set any time before
a call, even after triton was imported (importing torch can import it).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping

import torch

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except Exception as exc:  # a broken install must not break importing hyperparallel
    triton = tl = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"


def interpret() -> bool:
    """Whether triton.jit makes interpreted functions now (it reads the environment each time)."""
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4 parses the variable here
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def unavailable_reason(device: torch.device) -> str | None:
    """Why Triton kernels cannot run on tensors of `device` now (None: they can)."""
    device = torch.device(device)
    if triton is None:
        return f"triton cannot be imported ({IMPORT_ERROR}); install it with `pip install 'triton>=3.0'`"
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "CUDA is not available in this process"
    if device.type == "cpu":
        if interpret():
            return None
        return "triton kernels take CUDA tensors (CPU tensors only with TRITON_INTERPRET=1)"
    return f"triton kernels take CUDA tensors, not {device.type} tensors"


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: a context that makes it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _max_combine(a, b):
    return tl.maximum(a, b)


def _min_combine(a, b):
    return tl.minimum(a, b)


def _sum_combine(a, b):
    return a + b


# A reduction's combine function: (Triton's own in triton.language.standard, the fallback)
COMBINES = {"max": ("_elementwise_max", _max_combine), "min": ("_elementwise_min", _min_combine),
            "sum": ("_sum_combine", _sum_combine)}


class JitKernels:
    """One module's Triton kernels, jitted on first use (see [Note: kernels jitted on first use]).

    `namespace` is the module's globals(). `combines` names the combine functions of its
    reductions: global name -> "max", "min" or "sum" (COMBINES). Triton's own, in
    triton.language.standard, are preferred because the interpreter reduces with numpy only for
    those; not tl.max / tl.sum themselves, which are jit functions made when triton is imported and
    which the interpreter cannot call when triton was imported before TRITON_INTERPRET was set.
    Should a Triton version rename its own, this module's fallback is jitted instead.
    """

    def __init__(self, namespace: dict, combines: Mapping[str, str] | None = None):
        self._namespace = namespace
        self._combines = dict(combines or {})
        self._sources: dict[str, Callable] = {}
        self._built_for: bool | None = None  # the interpret mode the kernels were jitted in

    def register(self, fn: Callable) -> Callable:
        """A decorator: `fn` becomes a jit function of the module at the next build()."""
        self._sources[fn.__name__] = fn
        return fn

    def build(self) -> None:
        """Jit every registered function (again, if TRITON_INTERPRET changed since), rebinding
        the module's names."""
        mode = interpret()
        if self._built_for is mode:
            return
        for name, fn in self._sources.items():
            self._namespace[name] = triton.jit(fn)
        for name, kind in self._combines.items():
            standard, fallback = COMBINES[kind]
            self._namespace[name] = getattr(tl.standard, standard, None) or triton.jit(fallback)
        self._built_for = mode


__all__ = ["COMBINES", "IMPORT_ERROR", "JitKernels", "interpret", "on_device", "tl", "triton", "unavailable_reason"]
