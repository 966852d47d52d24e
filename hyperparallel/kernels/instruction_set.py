"""The instruction-set level every native library runs at: one choice for all of them.

csrc/hp_isa.h ([Note: one ISA choice]) defines the levels and the processor detection that every
library of csrc/ shares: "generic" (baseline x86-64, and any other processor), "avx2"
(x86-64-v3) and "avx512" (x86-64-v4). Each library starts at the best level the processor has;
`use_isa` moves all of them at once (tests hold every level to the reference on one machine,
benchmarks measure each), and `isa` reports the level in force. Results are the same at every
level, but for the order of some vector sums and, for MegaMHC, fused multiply-adds, which the
generic level does not have.
"""

from __future__ import annotations

from collections.abc import Callable

from hyperparallel.errors import BackendError, ConfigError

LEVELS = ("generic", "avx2", "avx512")

# library module -> (its hp_<name>_set_isa, its hp_<name>_isa), filled by kernels.native.load
_LIBRARIES: dict[str, tuple[Callable[[int], bytes], Callable[[], bytes]]] = {}
_chosen: int | None = None  # the level use_isa asked for (None: each library's best)


def register(module: str, set_isa: Callable[[int], bytes], get_isa: Callable[[], bytes]) -> None:
    """A loaded library joins the choice (kernels.native.load calls this); it is put at the level
    asked for so far, if any."""
    _LIBRARIES[module] = (set_isa, get_isa)
    if _chosen is not None:
        set_isa(_chosen)


def use_isa(level: str | int = "avx512") -> str:
    """Run every native library at `level` ("generic", "avx2", "avx512", or its index in LEVELS),
    or at the best below it the processor has; returns the level in force."""
    global _chosen
    if isinstance(level, str):
        if level not in LEVELS:
            raise ConfigError(f"instruction-set level {level!r} is not one of {', '.join(LEVELS)}")
        level = LEVELS.index(level)
    _chosen = level
    names = {set_isa(level).decode() for set_isa, _ in _LIBRARIES.values()}
    return _agreed(names)


def isa() -> str:
    """The level the native libraries run at ("generic" when none is built)."""
    return _agreed({get_isa().decode() for _, get_isa in _LIBRARIES.values()})


def _agreed(names: set[str]) -> str:
    # every library detects the processor with the same code (hp_isa.h), so they agree unless one
    # is a build of other sources (which the loader's version check should have refused)
    if len(names) > 1:
        raise BackendError(f"the native libraries run at different levels: {sorted(names)}: run `make setup`")
    return names.pop() if names else "generic"


__all__ = ["LEVELS", "isa", "use_isa"]
