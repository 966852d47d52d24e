"""hyperparallel: low-precision (MXFP8) large-model training for PyTorch."""

__version__ = "0.1.0"
