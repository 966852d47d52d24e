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

[Note: shared jit helpers] The helpers more than one kernel module calls (`reduce_max`,
`reduce_min`, `reduce_sum`: tl.reduce with Triton's own combine functions; `rounded`: fp32 to a
store's dtype, bf16 rounded to nearest even) are written once, at the end of this module, and
jitted here. A kernel module imports the ones it calls and names them in its JitKernels'
`shared`; its build() binds their jit functions in the module's namespace, where its kernels'
calls find them.

[Note: recorded launches] Inside `recorded_launches()` every JitKernels' build() binds its names
to recorders instead: ``kernel[grid](*args, **kwargs)`` appends a `Launch` and runs nothing, and
CPU tensors are accepted as a GPU's would be. So a kernel module's own wrappers, called on small
CPU tensors, say which specializations they launch; kernels.aot compiles those ahead of time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch

try:
    import triton
    import triton.language as tl

    IMPORT_ERROR: str | None = None
except Exception as exc:  # a broken install must not break importing hyperparallel
    triton = tl = None
    IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

_recording: list[Launch] | None = None  # the launches recorded now (see [Note: recorded launches])


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
        if interpret() or _recording is not None:
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


@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch recorded by `recorded_launches`: ``kernels``' kernel `name`, [grid](*args, **kwargs)."""

    kernels: JitKernels
    name: str
    grid: tuple
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a jit function while launches are recorded."""

    def __init__(self, kernels: JitKernels, name: str):
        self._kernels, self._name = kernels, name

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _recording.append(Launch(self._kernels, self._name, tuple(grid), args, kwargs))
        return launch


@contextlib.contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """The launches of every JitKernels' kernels inside, recorded instead of run (see [Note:
    recorded launches]); the kernels are jitted again at the next build() after."""
    global _recording
    if triton is None:
        raise RuntimeError(unavailable_reason(torch.device("cuda")))
    previous, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = previous


class JitKernels:
    """One module's Triton kernels, jitted on first use (see [Note: kernels jitted on first use]).

    `namespace` is the module's globals(). `combines` names the combine functions of its
    reductions: global name -> "max", "min" or "sum" (COMBINES). Triton's own, in
    triton.language.standard, are preferred because the interpreter reduces with numpy only for
    those; not tl.max / tl.sum themselves, which are jit functions made when triton is imported and
    which the interpreter cannot call when triton was imported before TRITON_INTERPRET was set.
    Should a Triton version rename its own, this module's fallback is jitted instead. `shared`
    names the helpers of this module that its kernels call (see [Note: shared jit helpers]).
    """

    def __init__(self, namespace: dict, combines: Mapping[str, str] | None = None, shared: Sequence[str] = ()):
        self._namespace = namespace
        self._combines = dict(combines or {})
        self._shared = tuple(shared)
        if unknown := [name for name in self._shared if name not in _SHARED._sources]:
            raise ValueError(f"{self.module}: {unknown} are no shared jit helpers of {__name__}")
        self._sources: dict[str, Callable] = {}
        self._built_for: bool | str | None = None  # the interpret mode the kernels were jitted in, or "record"

    def register(self, fn: Callable) -> Callable:
        """A decorator: `fn` becomes a jit function of the module at the next build()."""
        self._sources[fn.__name__] = fn
        return fn

    @property
    def module(self) -> str:
        return self._namespace["__name__"]

    def build(self) -> None:
        """Jit every registered function (again, if TRITON_INTERPRET changed since), rebinding
        the module's names; recorders instead while launches are recorded."""
        mode = "record" if _recording is not None else interpret()
        if self._built_for == mode and (not self._shared or _SHARED._built_for == mode):
            return  # (the shared helpers too: another module may have built them for another mode since)
        for name, fn in self._sources.items():
            self._namespace[name] = _Recorder(self, name) if mode == "record" else triton.jit(fn)
        self._namespace.update({name: _SHARED.jitted(name) for name in self._shared})
        for name, kind in self._combines.items():
            standard, fallback = COMBINES[kind]
            own = getattr(tl.standard, standard, None)
            if mode is False and not isinstance(own, triton.runtime.JITFunction):
                own = None  # made while the interpreter was on (triton imported then): it cannot compile
            self._namespace[name] = own or triton.jit(fallback)
        self._built_for = mode

    def jitted(self, name: str):
        """The jit function of kernel `name` as a launch now gets it."""
        self.build()
        return self._namespace[name]


# ------------------------------------------------------------------------- shared jit helpers
# Plain functions, made triton.jit functions of this module by _SHARED.build(), which a kernel
# module's build() calls when its `shared` names any (see [Note: shared jit helpers]).

_SHARED = JitKernels(globals(), combines={"_MAX": "max", "_MIN": "min", "_SUM": "sum"})
_MAX = _MIN = _SUM = None  # set by _SHARED.build()


@_SHARED.register
def reduce_max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MAX)


@_SHARED.register
def reduce_min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _MIN)


@_SHARED.register
def reduce_sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, _SUM)


@_SHARED.register
def rounded(x, dtype: tl.constexpr):
    """fp32 x in `dtype`, rounded to nearest even. bf16 by hand: the interpreter's cast truncates."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        nearest = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        nearest = tl.where(x != x, 0x7FC0, nearest)  # NaN stays NaN
        return nearest.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


__all__ = ["COMBINES", "IMPORT_ERROR", "JitKernels", "Launch", "interpret", "on_device", "recorded_launches",
           "reduce_max", "reduce_min", "reduce_sum", "rounded", "tl", "triton", "unavailable_reason"]
