"""Counting host reads: the operations that make the host wait for the device on CUDA.

A TorchDispatchMode sees every ATen operation a piece of code runs, on any device, so the CPU
path of the same code shows which of its operations would be device-to-host syncs on a GPU:
reading a value (`item`, `int()`, `float()`, `bool()`: `_local_scalar_dense`; `tolist`, `cpu`
and `numpy`, which on a CPU tensor run no operation, are recorded under their names by wrapping
them),
`equal`, anything whose output size depends on values (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`, `repeat_interleave` without `output_size`), and copies from a device
to the CPU. `torch._assert_async` is not one: on CUDA it asserts on the device.

    with HostReads() as reads:
        step()
    assert reads.sites() == {...}   # {(op, "package/file.py:line"): count}

Each read is recorded with the innermost frame of hyperparallel's own code that led to it, so a
failing assertion names the line. Products (mm, addmm, bmm, grouped products, custom ops of
this package that wrap them) are recorded with their operands' dtypes in `products`.
"""

from __future__ import annotations

import collections
import os
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hyperparallel

_VALUE_READS = {"_local_scalar_dense", "equal", "nonzero", "nonzero_static", "argwhere", "masked_select",
                "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
             "mx_grouped_mm_native", "grouped_mm", "grouped_mm_weight_grad"}


_PACKAGE = os.path.dirname(os.path.abspath(hyperparallel.__file__)) + os.sep
# Tensor methods that read a CPU tensor's memory without an ATen operation (on a device each
# copies to the CPU first: that copy is what is counted there)
_CPU_READS = ("tolist", "cpu", "numpy")


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if os.path.abspath(f.filename).startswith(_PACKAGE)]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{os.path.relpath(os.path.abspath(frame.filename), _PACKAGE)}:{frame.lineno}"


def _is_read(func, name: str, args, kwargs) -> bool:
    if name in _VALUE_READS:
        return True
    if name == "repeat_interleave":  # repeats as a tensor (the other overloads decompose into this one)
        return func._overloadname == "Tensor" and kwargs.get("output_size") is None
    if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1] if i is not None):
        return True
    if name in ("_to_copy", "copy_"):
        source = args[1] if name == "copy_" else args[0]
        target = args[0].device if name == "copy_" else kwargs.get("device")
        return (isinstance(source, torch.Tensor) and source.device.type not in ("cpu", "meta")
                and target is not None and torch.device(target).type == "cpu")
    return False


class HostReads(TorchDispatchMode):
    """Records host reads (see the module docstring) and products while it is active."""

    def __init__(self):
        super().__init__()
        self.reads: collections.Counter = collections.Counter()
        self.products: collections.Counter = collections.Counter()

    def __enter__(self):
        # the methods of _CPU_READS, wrapped to count their CPU reads: only this thread's
        reads, owner = self.reads, threading.get_ident()
        self._own = {name: torch.Tensor.__dict__.get(name) for name in _CPU_READS}

        def counted(name, original):
            def method(tensor, *args, **kwargs):
                if threading.get_ident() == owner and tensor.device.type == "cpu":
                    reads[(name, _site())] += 1
                return original(tensor, *args, **kwargs)
            return method

        for name in _CPU_READS:
            setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, own in self._own.items():
            if own is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, own)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name.split("::")[-1]
        if _is_read(func, name, args, kwargs):
            self.reads[(name, _site())] += 1
        if name in _PRODUCTS:
            dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point())
            self.products[(name, dtypes)] += 1
        return func(*args, **kwargs)

    def sites(self) -> dict[tuple[str, str], int]:
        return dict(self.reads)

    def total(self) -> int:
        return sum(self.reads.values())

    def product_dtypes(self) -> set[torch.dtype]:
        return {dtype for (_, dtypes) in self.products for dtype in dtypes}
