"""transformers' sparse MoE blocks swapped for hyperparallel.moe's: the router, GroupedExperts and
the shared experts under the same names, holding the same Parameter (and bias buffer) objects.

After the swap the model computes what transformers' eager modules compute (the same routing,
the experts as grouped products), and state dicts, checkpoints and optimizers see no difference.
The router and experts stand in for the classes they replaced (models/standins.py), so
transformers' own machinery still finds them: `output_router_logits` records our routers' logits,
`init_weights()` and `from_pretrained`'s missing keys initialize them with the family's
distributions, and `set_experts_implementation` reaches the experts (grouped_mm is ours; another
runs transformers' implementation on the same Parameters, or is refused where it cannot).
"""

from __future__ import annotations

from torch import nn

from hyperparallel.moe import GroupedExperts, MoEBlock

from .families import all_moe_block_classes, router_from_hf
from .standins import stand_in


def moe_block_from_hf(block: nn.Module) -> MoEBlock:
    """The MoEBlock for one of transformers' sparse MoE blocks (Qwen3-MoE, DeepSeek-V3)."""
    modules = {}
    for name, child in block.named_children():  # in the HF block's order: a seed initializes alike
        if name == "gate":
            modules[name] = router_from_hf(child)
        elif name == "experts":
            modules[name] = child if isinstance(child, GroupedExperts) else stand_in(GroupedExperts.from_hf(child), child)
        elif name == "shared_experts":
            modules[name] = child
        else:
            raise NotImplementedError(f"{type(block).__name__}.{name}: MoEBlock has no place for it")
    return MoEBlock(modules)


def swap_moe_blocks(model: nn.Module) -> int:
    """Replace every sparse MoE block of a supported family with a MoEBlock; return how many.

    Raises RuntimeError if any parameter or buffer changed object or name (a bug here, which
    would silently detach optimizers, tied weights and sharding from the model).
    """
    before = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, all_moe_block_classes())]
    for name, module in targets:
        model.set_submodule(name, moe_block_from_hf(module))
    if targets and not _experts_implementation_settable(model):
        # transformers then runs its eager loop whatever is asked, and set_experts_implementation
        # refuses: ours keep their grouped products instead of following the config to that loop
        for block in model.modules():
            if isinstance(block, MoEBlock):
                block.experts.__dict__.pop("config", None)
    after = dict(model.named_parameters(remove_duplicate=False))
    lost = [name for name, param in before.items() if after.get(name) is not param]
    after_buffers = dict(model.named_buffers(remove_duplicate=False))
    lost += [name for name, buf in buffers.items() if after_buffers.get(name) is not buf]
    if lost or after.keys() != before.keys() or after_buffers.keys() != buffers.keys():
        raise RuntimeError(f"swap_moe_blocks changed parameters or buffers: {lost or sorted(after.keys() ^ before.keys())}")
    return len(targets)


def _experts_implementation_settable(model: nn.Module) -> bool:
    """Whether transformers lets this model's experts implementation be chosen (it does not for a
    model class whose module source it cannot read: defined in a notebook, say)."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    return can_set is None or can_set()
