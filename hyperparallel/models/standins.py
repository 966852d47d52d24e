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

from torch import nn

_STAND_INS: dict[tuple[type, type], type] = {}  # (ours, theirs) -> the stand-in class
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
                                               "stands_in_for": theirs, "__reduce_ex__": _reduce_ex})
    return cls


def _reduce_ex(self, protocol):
    """A stand-in pickles (and deep-copies) as the pair of classes it is made of, each by its own
    module and name, so a fresh process unpickling it imports the transformers modeling module it
    stands in for, and makes the same class again (`_new`); its state follows, set once the object
    exists (so references back to it, a hook bound to it, copy to the copy). A class made from a
    stand-in by someone else (a wrapper's subclass) pickles as Python pickles any object."""
    cls = type(self)
    if "stands_in_for" not in vars(cls):
        return object.__reduce_ex__(self, protocol)
    return _new, (cls.__bases__[0], cls.stands_in_for), self.__getstate__()


def _new(ours: type[nn.Module], theirs: type[nn.Module]) -> nn.Module:
    return nn.Module.__new__(stand_in_class(ours, theirs))


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
