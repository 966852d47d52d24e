"""MXFP8 training: choose modules by configuration and swap them for MXFP8 versions that reuse
the original Parameters."""

from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.convert import ConversionReport, convert
from hyperparallel.lowp.linear import MXLinear

__all__ = ["ConversionReport", "LowPrecisionConfig", "MXLinear", "convert"]
