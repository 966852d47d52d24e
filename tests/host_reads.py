"""Counting host reads: the operations that make the host wait for the device on CUDA.

A TorchDispatchMode sees every ATen operation a piece of code runs, on any device, so the CPU
path of the same code shows which of its operations would be device-to-host syncs on a GPU:
reading a value (`item`, `int()`, `float()`, `bool()`: `_local_scalar_dense`; `tolist`, which
on the CPU reads memory without an operation, is recorded as "tolist" by wrapping it),
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
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_VALUE_READS = {"_local_scalar_dense", "equal", "nonzero", "nonzero_static", "argwhere", "masked_select",
                "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"}
_PRODUCTS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "_scaled_mm", "_scaled_grouped_mm",
             "mx_grouped_mm_native", "grouped_mm", "grouped_mm_weight_grad"}


def _site() -> str:
    frames = [f for f in traceback.extract_stack() if "/hyperparallel/" in f.filename]
    if not frames:
        return "?"
    frame = frames[-1]
    return f"{frame.filename.rsplit('/hyperparallel/', 1)[-1]}:{frame.lineno}"


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
        # Tensor.tolist on a CPU tensor runs no ATen operation, so the mode would not see it (on a
        # device it copies to the CPU first: that copy is what is counted). Only this thread's.
        reads, owner = self.reads, threading.get_ident()
        self._own_tolist = torch.Tensor.__dict__.get("tolist")
        original = torch.Tensor.tolist

        def tolist(tensor):
            if threading.get_ident() == owner and tensor.device.type == "cpu":
                reads[("tolist", _site())] += 1
            return original(tensor)

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        if self._own_tolist is None:
            del torch.Tensor.tolist
        else:
            torch.Tensor.tolist = self._own_tolist
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
