"""MXFP8 as a data format and as operators (OCP MX v1.0): no nn.Module, no autograd."""

from hyperparallel.mx.format import BLOCK_SIZE
from hyperparallel.mx.matmul import mx_grouped_mm, mx_mm
from hyperparallel.mx.quantize import dequantize, quantize, quantize_dual, quantize_grouped
from hyperparallel.mx.tensor import MXTensor

__all__ = [
    "BLOCK_SIZE",
    "MXTensor",
    "dequantize",
    "mx_grouped_mm",
    "mx_mm",
    "quantize",
    "quantize_dual",
    "quantize_grouped",
]
