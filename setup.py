"""Builds the native CPU kernels (plain C, OpenMP) next to the Python package.

The library has no Python entry point: hyperparallel.mx.backends.cpu loads it with ctypes.
The build is portable: AVX-512 and AVX2 code paths are chosen at run time, never -march=native.
"""

import platform

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildPlainC(build_ext):
    """A ctypes library exports no PyInit_ function; do not ask the linker for one."""

    def get_export_symbols(self, ext):
        return ext.export_symbols


def compile_args():
    args = ["-O3", "-fopenmp", "-std=c11", "-Wall", "-Wextra", "-fno-strict-aliasing"]
    if platform.machine() not in ("x86_64", "AMD64"):
        args.append("-DHP_NO_AVX512")
    return args


setup(
    ext_modules=[
        Extension(
            "hyperparallel._mx_native",
            sources=["csrc/mx_quant.c", "csrc/mx_generic.c", "csrc/mx_avx512.c", "csrc/mx_cache.c"],
            include_dirs=["csrc"],
            extra_compile_args=compile_args(),
            extra_link_args=["-fopenmp"],
        )
    ],
    cmdclass={"build_ext": BuildPlainC},
)
