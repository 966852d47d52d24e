"""MXFP8 training: choose modules by configuration and swap them for MXFP8 versions that reuse
the original Parameters."""

from hyperparallel.lowp.config import LowPrecisionConfig
from hyperparallel.lowp.convert import ConversionReport, convert, is_mx_experts
from hyperparallel.lowp.grouped import MXExpertsRecipe
from hyperparallel.lowp.linear import MXLinear

__all__ = ["ConversionReport", "LowPrecisionConfig", "MXExpertsRecipe", "MXLinear", "convert", "is_mx_experts"]
