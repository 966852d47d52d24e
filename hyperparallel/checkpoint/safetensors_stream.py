"""Write a safetensors file header first, then its tensors one at a time, in any order.

`safetensors.torch.save_file` takes every tensor of a file at once. A file whose tensors' names,
dtypes and shapes are known beforehand can instead be laid out first: the format is an 8-byte
little-endian header length, a JSON header (each tensor's dtype, shape and byte range in the data
that follows, and `__metadata__`), padded with spaces to a multiple of 8 bytes, then the tensors'
raw little-endian bytes back to back, with no holes. `SafetensorsWriter` writes the header when
it opens the file and each tensor's bytes at its place when it is given, so a writer holds only
the tensor it is writing. Within a file the data is ordered by element size, largest first (as
safetensors does), so that every tensor starts aligned to its element size.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hyperparallel.errors import CheckpointError

# torch's dtypes by their safetensors names
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_ALIGNMENT = 8  # the header is padded so that the data starts at a multiple of this
_MAX_WRITE = 1 << 30  # bytes per system call (Linux writes at most ~2 GiB at once)


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of a file, before its data exists."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * self.dtype.itemsize


def layout(specs: Sequence[TensorSpec]) -> dict[str, tuple[int, int]]:
    """Each tensor's byte range in the data: by element size, largest first, then by name."""
    ranges, start = {}, 0
    for spec in sorted(specs, key=lambda s: (-s.dtype.itemsize, s.name)):
        ranges[spec.name] = (start, start + spec.nbytes)
        start += spec.nbytes
    return ranges


def header_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> bytes:
    """The 8-byte length and the padded JSON header of a file of these tensors."""
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    for spec in specs:
        if spec.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"{spec.name} is {spec.dtype}, which safetensors cannot store")
    ranges = layout(specs)
    for spec in sorted(specs, key=lambda s: ranges[s.name]):
        header[spec.name] = {"dtype": DTYPE_NAMES[spec.dtype], "shape": list(spec.shape),
                             "data_offsets": list(ranges[spec.name])}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGNMENT)
    return len(text).to_bytes(8, "little") + text


def file_bytes(specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None) -> int:
    """The size of the file these tensors make."""
    return len(header_bytes(specs, metadata)) + sum(spec.nbytes for spec in specs)


class SafetensorsWriter:
    """One safetensors file: its header written on opening, each tensor's bytes by `write`.

    Every tensor must be written exactly once before `close`, which refuses (and removes the
    file) otherwise; a context manager removes it, too, when the block raises."""

    def __init__(self, path: str | os.PathLike, specs: Sequence[TensorSpec], metadata: Mapping[str, str] | None = None):
        names = [spec.name for spec in specs]
        if len(set(names)) != len(names):
            raise CheckpointError(f"{path}: a tensor name is given twice")
        self.path = Path(path)
        self.specs = {spec.name: spec for spec in specs}
        header = header_bytes(specs, metadata)
        self._data_start = len(header)
        self._ranges = layout(specs)
        self._pending = set(names)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            self._write_at(0, memoryview(header))
            os.ftruncate(self._fd, self._data_start + sum(spec.nbytes for spec in specs))
        except BaseException:
            self.abandon()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """`tensor`'s bytes at the place of `name` (its dtype and shape must be the header's)."""
        spec = self.specs.get(name)
        if spec is None or name not in self._pending:
            raise CheckpointError(f"{self.path}: {name} is {'written already' if spec else 'not in this file'}")
        if tensor.dtype != spec.dtype or tuple(tensor.shape) != spec.shape:
            raise CheckpointError(f"{self.path}: {name} is {tensor.dtype} {tuple(tensor.shape)}, but its header says "
                                  f"{spec.dtype} {spec.shape}")
        raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        start, _ = self._ranges[name]
        if raw.numel():
            self._write_at(self._data_start + start, memoryview(raw.numpy()))
        self._pending.discard(name)

    def _write_at(self, offset: int, data: memoryview) -> None:
        done = 0
        while done < len(data):
            done += os.pwrite(self._fd, data[done:done + _MAX_WRITE], offset + done)

    def close(self) -> None:
        if self._fd is None:
            return
        if self._pending:
            missing = ", ".join(sorted(self._pending)[:3])
            self.abandon()
            raise CheckpointError(f"{self.path}: {len(self._pending)} tensors were never written ({missing}, ...)")
        os.close(self._fd)
        self._fd = None

    def abandon(self) -> None:
        """Close and remove the file, unless it was closed complete."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abandon()
