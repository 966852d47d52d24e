"""What every fused kernel needs, once, and the fused kernels MegaGate and MegaMHC.

- `native`: the one loader of csrc/'s native libraries (ctypes), with one version check (a stale
  build is never called) and the reason a library is unavailable;
- `instruction_set`: the one instruction-set choice of every native library (AVX-512, AVX2 or
  portable; csrc/hp_isa.h): `isa()`, `use_isa(level)`;
- `triton_support`: the guarded ``import triton``, Triton's interpreter mode, kernels jitted on
  first use and again when the mode changes, why Triton cannot run on a device;
- `host_cache`: large CPU outputs from reused buffers instead of fresh pages;
- `backends`: a fused operation's backend per device (native C, Triton, the reference) and the
  check of a backend asked for by name; the custom-op conventions they share;
- `mega_gate`: MegaGate, everything a MoE router does after its logits (moe's TopKRouter calls it);
- `mega_mhc`: MegaMHC, DeepSeek-V4's hyper-connections (models.deepseek_v4 uses it).

Depends on torch and errors only: mx's CPU backend, fusion's VM and the fused kernels load their
libraries here, and nothing here imports them.
"""

from hyperparallel.kernels.instruction_set import LEVELS, isa, use_isa

__all__ = ["LEVELS", "isa", "use_isa"]
