"""MXFP8 training: choose modules by configuration and swap them for MXFP8 versions that reuse
the original Parameters."""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "config": ("LowPrecisionConfig",),
    "conversion": ("ConversionReport", "convert", "is_mx_experts"),
    "grouped": ("MXExpertsRecipe",),
    "linear": ("MXLinear",),
})
