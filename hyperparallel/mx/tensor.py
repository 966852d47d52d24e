"""MXTensor: FP8 elements, their E8M0 block scales, and the axis the blocks run along."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from hyperparallel.errors import ShapeError
from hyperparallel.mx import reference
from hyperparallel.mx.backends import get_backend
from hyperparallel.mx.format import BLOCK_SIZE


@dataclass(frozen=True)
class MXTensor:
    """A tensor quantized in blocks of 32 along `axis`.

    ``data`` has the logical shape (float8); ``scale`` (float8_e8m0fnu) has the same shape with
    the `axis` dimension replaced by ceil(n / 32), or, for a grouped tensor, by M // 32 + E (see
    ``hyperparallel.mx.groups``). ``group_offsets`` (cumulative group ends along `axis`) is set
    only for grouped tensors. Instances are plain containers: no autograd, no __torch_function__.
    """

    data: torch.Tensor
    scale: torch.Tensor
    axis: int
    scale_mode: str = "rceil"
    group_offsets: torch.Tensor | None = None
    block_size: int = BLOCK_SIZE

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def elem_dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def t(self) -> MXTensor:
        """Transpose a 2-D MXTensor: data and scale are transposed views, the axis swaps."""
        if self.data.dim() != 2:
            raise ShapeError(f"MXTensor.t() takes a 2-D tensor, this one has shape {tuple(self.shape)}")
        return replace(self, data=self.data.t(), scale=self.scale.t(), axis=1 - self.axis)

    def dequantize(self, dtype: torch.dtype = torch.float32, *, backend: str | None = None) -> torch.Tensor:
        """The values in `dtype` (each rounded once from its exact value)."""
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise ShapeError(f"dequantize needs a float dtype of 16 bits or more, got {dtype}")
        impl = get_backend(backend, self.device)
        if dtype == torch.float64:  # float32 cannot hold every exact value (E8M0 spans 2^+-127)
            impl = reference
        return impl.dequantize(self.data, self.scale, self.axis, self.group_offsets, dtype)

    def __repr__(self) -> str:
        grouped = f", groups={len(self.group_offsets)}" if self.group_offsets is not None else ""
        return (
            f"MXTensor(shape={tuple(self.shape)}, elem={self.elem_dtype}, axis={self.axis}, "
            f"scale_mode={self.scale_mode!r}{grouped})"
        )
