"""Builds the native CPU kernels (plain C, OpenMP) next to the Python package.

Libraries with no Python entry point, loaded with ctypes by hyperparallel.kernels.native: _mx_native
(MX quantization, hyperparallel.mx.backends.native; and the host buffer cache,
hyperparallel.kernels.host_cache), _dvm_native (the DVM bytecode interpreter,
hyperparallel.fusion.vm), _mega_gate_native (MegaGate, the fused MoE router,
hyperparallel.kernels.mega_gate) and _mega_mhc_native (MegaMHC, DeepSeek-V4's fused
hyper-connections, hyperparallel.kernels.mega_mhc). The build is portable: AVX-512 and AVX2 code
paths are chosen at run time, never -march=native, every library at the level csrc/hp_isa.h
decides (hyperparallel.kernels.use_isa).
"""

import importlib.util
import os
import platform
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError


class BuildPlainC(build_ext):
    """A ctypes library exports no PyInit_ function; do not ask the linker for one. Without a
    working C compiler the package installs all the same: each operation then runs its portable
    torch path (hyperparallel.kernels.native says why a library is unavailable), and the build
    says so in one line."""

    def get_export_symbols(self, ext):
        return ext.export_symbols

    def run(self):
        self.not_built = []
        super().run()
        if self.not_built:
            names = ", ".join(name.split(".")[-1] for name, _ in self.not_built)
            print(f"hyperparallel: no native CPU kernels built ({names}: {self.not_built[0][1]}); "
                  "the portable torch paths run instead", file=sys.stderr)

    def build_extension(self, ext):
        if self.not_built:  # (the compiler that failed once fails again: one line, not four)
            self._not_built(ext, self.not_built[0][1])
            return
        try:
            super().build_extension(ext)
        except CCompilerError as error:  # (no compiler, or one that fails: CompileError, LinkError)
            # a checkout's `make setup` must build them: there a failure is the code's, not the machine's
            if os.environ.get("HYPERPARALLEL_NATIVE_REQUIRED") == "1":
                raise
            self._not_built(ext, (str(error).splitlines() or [type(error).__name__])[0][:160])

    def _not_built(self, ext, why: str) -> None:
        # (this build's own output, never the checkout's: setuptools builds into build_lib and copies
        # from there; none older than the sources may ship)
        Path(self.get_ext_fullpath(ext.name)).unlink(missing_ok=True)
        self.not_built.append((ext.name, why))


def generate_vf_table():
    """csrc/generated/dvm_vf_table.h: the DVM's precompiled vector functions, written from
    hyperparallel/fusion/vf_table.txt by vf_spec.py (standard library only: no torch needed)."""
    path = Path(__file__).parent / "hyperparallel" / "fusion" / "vf_spec.py"
    spec = importlib.util.spec_from_file_location("hp_vf_spec", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up)
    spec.loader.exec_module(module)
    module.main([str(module.TABLE), str(Path(__file__).parent / "csrc" / "generated" / "dvm_vf_table.h")])


def compile_args():
    # no contraction into fused multiply-adds (GCC's default under -std=c11; clang's is to contract
    # within an expression): the DVM's VFs and row sums round as their documented order says
    args = ["-O3", "-fopenmp", "-std=c11", "-ffp-contract=off", "-Wall", "-Wextra", "-fno-strict-aliasing"]
    if platform.machine() not in ("x86_64", "AMD64"):
        args.append("-DHP_NO_AVX512")
    return args


generate_vf_table()
# optional: an install without a compiler (an editable one too) copies only what was built
OPTIONAL = os.environ.get("HYPERPARALLEL_NATIVE_REQUIRED") != "1"
setup(
    ext_modules=[
        Extension(
            "hyperparallel._mx_native",
            sources=["csrc/mx_quant.c", "csrc/mx_generic.c", "csrc/mx_avx512.c", "csrc/mx_cache.c"],
            include_dirs=["csrc"],
            depends=["csrc/mx_common.h", "csrc/hp_isa.h"],
            extra_compile_args=compile_args(),
            extra_link_args=["-fopenmp"],
            optional=OPTIONAL,
        ),
        Extension(
            "hyperparallel._dvm_native",
            sources=["csrc/dvm_vm.c", "csrc/dvm_generic.c", "csrc/dvm_avx2.c", "csrc/dvm_avx512.c"],
            include_dirs=["csrc"],
            depends=["csrc/dvm_vm.h", "csrc/dvm_kernels.h", "csrc/dvm_math.h", "csrc/hp_isa.h",
                     "csrc/generated/dvm_vf_table.h"],
            # sqrtf without errno is one instruction, and FP operations may be computed ahead of a
            # select (both sides of `c ? a : b`): what lets GCC vectorize the interpreter's loops.
            # Neither changes a result (no -ffast-math).
            extra_compile_args=compile_args() + ["-fno-math-errno", "-fno-trapping-math"],
            extra_link_args=["-fopenmp"],
            libraries=["m"],  # sinf, cosf, powf outside the vectorized ranges
            optional=OPTIONAL,
        ),
        Extension(
            "hyperparallel._mega_gate_native",
            sources=["csrc/mega_gate.c"],
            include_dirs=["csrc"],
            depends=["csrc/dvm_math.h", "csrc/hp_isa.h"],
            extra_compile_args=compile_args(),
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=OPTIONAL,
        ),
        Extension(
            "hyperparallel._mega_mhc_native",
            sources=["csrc/mega_mhc.c"],
            include_dirs=["csrc"],
            depends=["csrc/hp_isa.h"],
            extra_compile_args=compile_args(),
            extra_link_args=["-fopenmp"],
            libraries=["m"],
            optional=OPTIONAL,
        ),
    ],
    cmdclass={"build_ext": BuildPlainC},
)
