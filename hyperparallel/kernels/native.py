"""The native libraries of csrc/, loaded with ctypes: one loader and one version check for all.

Each library is plain C with no Python or PyTorch headers, built by the package build (setup.py)
as ``hyperparallel._<name>_native`` and found as that module's file. [Note: native libraries]
`load` gives the library with its functions typed from a table of signatures, or None when it
cannot be used, and `unavailable_reason` says why:
- not built: no such module (the fast path's users then run their reference, or report it);
- a stale build, older than the Python code that calls it: a function of the table is missing,
  or the library's version function returns another version than this code was written against
  (`VERSIONS`). A stale library is never called: its arguments may have changed.
A library with instruction-set levels (csrc/hp_isa.h: hp_<name>_set_isa, hp_<name>_isa) is put
at the level `hyperparallel.kernels.use_isa` has chosen for every library.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Mapping

from hyperparallel.kernels import instruction_set as _isa

# A function's ctypes (argtypes, restype); argtypes None leaves the arguments unconverted (the
# caller passes ctypes objects of the exact C types, as the DVM's hot call does).
Signature = tuple[list | None, type | None]
# The C types the libraries' signature tables are written in: a pointer (void *, a tensor's data),
# int64_t, int, float.
PTR, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float

# Each library's version function (csrc: hp_<name>_version) and the version this code was written
# against: the C side raises it whenever a function's arguments or meaning change.
VERSIONS = {
    "hyperparallel._mx_native": ("hp_mx_version", 2),
    "hyperparallel._dvm_native": ("hp_dvm_version", 3),
    "hyperparallel._mega_gate_native": ("hp_mega_gate_version", 1),
    "hyperparallel._mega_mhc_native": ("hp_mega_mhc_version", 1),
}

_REASONS: dict[str, str] = {}


def load(module: str, signatures: Mapping[str, Signature], *, isa: str | None = None) -> ctypes.CDLL | None:
    """The native library `module` (``"hyperparallel._mx_native"``) with the functions of
    `signatures` typed, or None if it is not built, cannot be loaded or is a stale build (see
    [Note: native libraries]; its version from `VERSIONS`). `isa` = the prefix of its level
    functions (``"hp_mx"`` for hp_mx_set_isa, hp_mx_isa), which are then typed too and follow
    `kernels.use_isa`."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return _unavailable(module, "is not built (no C compiler where it was installed; in a checkout: "
                                    "run `make setup`)")
    try:
        lib = ctypes.CDLL(spec.origin)
    except OSError as e:  # (built for another machine, or a library it links is missing)
        return _unavailable(module, f"cannot be loaded ({e}): run `make setup`")
    version = VERSIONS.get(module)
    table = dict(signatures)
    if version is not None:
        table[version[0]] = ([], ctypes.c_int)
    if isa is not None:
        table.update({f"{isa}_set_isa": ([ctypes.c_int], ctypes.c_char_p), f"{isa}_isa": ([], ctypes.c_char_p)})
    missing = [name for name in table if not hasattr(lib, name)]
    if missing:
        return _unavailable(module, f"is a stale build (it has no {missing[0]}): run `make setup`")
    for name, (argtypes, restype) in table.items():
        fn = getattr(lib, name)
        if argtypes is not None:
            fn.argtypes = argtypes
        fn.restype = restype
    if version is not None and (found := getattr(lib, version[0])()) != version[1]:
        return _unavailable(module, f"is a stale build ({version[0]}() is {found}, this code needs {version[1]}): "
                                    "run `make setup`")
    if isa is not None:
        _isa.register(module, getattr(lib, f"{isa}_set_isa"), getattr(lib, f"{isa}_isa"))
    return lib


def not_built() -> list[str]:
    """The native libraries this install has no build of (a source install without a C compiler:
    setup.py builds none, and every operation runs its portable torch path)."""
    return [module for module in VERSIONS if importlib.util.find_spec(module) is None]


def unavailable_reason(module: str) -> str | None:
    """Why a `load(module, ...)` gave None (None if none did). A later load that succeeds, with
    another table, leaves the reason: the caller that got None still holds None."""
    return _REASONS.get(module)


def _unavailable(module: str, why: str) -> None:
    _REASONS[module] = f"the native library {module} {why}"
    return None


__all__ = ["F32", "I64", "INT", "PTR", "VERSIONS", "Signature", "load", "not_built", "unavailable_reason"]
