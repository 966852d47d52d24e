"""Our MoE modules standing in for transformers' own, to transformers' eyes too.

`swap_moe_blocks` puts a `TopKRouter` where a transformers router was and a `GroupedExperts` where
its experts module was. transformers finds those modules by class: its output recorder hooks
`isinstance(module, Qwen3MoeTopKRouter)` to collect `router_logits` (`_can_record_outputs`), and
each family's `_init_weights` initializes `isinstance(module, Qwen3MoeExperts)`. So a swapped
module's class becomes a stand-in: a subclass of ours first (every method, forward included, is
ours) and of the transformers class it replaced second (`isinstance` holds). The recorder then
records our router's logits, output 0 as transformers' routers return them, and `init_weights()`,
`from_pretrained`'s missing keys and our seeded init all draw the family's own distributions,
from transformers' own code. Where transformers records nothing (DeepSeek-V4's hash routers), it
records nothing from ours either.

Forward hooks on the replaced module (the recorder's, when a recorded forward ran before the
swap, or a user's) move to ours with it; backward hooks do not (torch keeps full backward hooks'
state beside them). The public attributes transformers' methods read of the instance (the
experts' `config`, through which `set_experts_implementation` reaches them, and their layout
flags) are copied where ours has none of that name; private ones (a compiled call, an
accelerate hook bound to the old module) are not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn

_STAND_INS: dict[tuple[type, type], type] = {}  # (ours, theirs) -> the stand-in class
# What gives the classes ours may stand in for, importing their modules (`register_classes`)
_CLASSES: list[Callable[[], Iterable[type[nn.Module]]]] = []
_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
          "_forward_pre_hooks_with_kwargs")
_READ_BY_TRANSFORMERS = ("_is_expert_parallel",)  # the private attributes transformers' experts code reads


def _refuse_init(self, *args, **kwargs):
    raise TypeError(f"{type(self).__name__} is made by swap_moe_blocks from a transformers module; build "
                    f"{type(self).__mro__[1].__name__} instead")


def stand_in_class(ours: type[nn.Module], theirs: type[nn.Module]) -> type[nn.Module]:
    """The class `ours` takes when it replaces a `theirs` (one per pair, named after both)."""
    cls = _STAND_INS.get((ours, theirs))
    if cls is None:
        # (__init__ refused: built directly, TopKRouter's super().__init__() would reach theirs)
        cls = _STAND_INS[ours, theirs] = type(f"{theirs.__name__}As{ours.__name__}", (ours, theirs),
                                              {"__module__": __name__, "__init__": _refuse_init,
                                               "stands_in_for": theirs})
    return cls


def stand_in(ours: nn.Module, replaced: nn.Module) -> nn.Module:
    """`ours`, now also an instance of `replaced`'s class, with `replaced`'s hooks."""
    if isinstance(ours, type(replaced)):
        return ours
    ours.__class__ = stand_in_class(type(ours), type(replaced))
    for hooks in _HOOKS:
        getattr(ours, hooks).update(getattr(replaced, hooks))
    for name, value in vars(replaced).items():
        public = not name.startswith("_") or name in _READ_BY_TRANSFORMERS
        if public and not hasattr(ours, name):  # (ours keeps its own of a name, instance or class)
            setattr(ours, name, value)
    return ours


def stands_in(module: nn.Module) -> bool:
    """Whether `module` is one of ours standing in for a transformers module."""
    return "stands_in_for" in vars(type(module))


def register_classes(classes: Callable[[], Iterable[type[nn.Module]]]) -> None:
    """`classes()` gives transformers classes a module of ours may stand in for, importing their
    modeling modules (models.families registers its tuned families' MoE classes when imported):
    unpickling finds the stand-ins of every class of those modules."""
    _CLASSES.append(classes)


def __getattr__(name: str) -> type[nn.Module]:
    """A stand-in class by name (what unpickling a swapped model asks this module for): the class
    it replaced is looked up among transformers' modeling modules already imported (a fresh process
    unpickling a model has imported its modeling module first: the model's class comes first in the
    pickle), after those of `register_classes`."""
    if name.startswith("__") or "As" not in name:  # (the import system asks modules for __path__ and the like)
        raise AttributeError(name)
    import sys

    from hyperparallel.moe import GroupedExperts, TopKRouter

    theirs_name, ours_name = name.rsplit("As", 1)
    ours = {"GroupedExperts": GroupedExperts, "TopKRouter": TopKRouter}.get(ours_name)
    if ours is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    for classes in _CLASSES:
        classes()  # (imports their modeling modules)
    for module_name, module in list(sys.modules.items()):
        theirs = getattr(module, theirs_name, None) if module_name.startswith("transformers.models.") else None
        if isinstance(theirs, type) and issubclass(theirs, nn.Module):
            return stand_in_class(ours, theirs)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
