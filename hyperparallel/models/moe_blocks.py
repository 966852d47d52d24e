"""transformers' MoE layers run on hyperparallel.moe's modules, holding the same Parameter (and
bias buffer) objects under the same names.

- Every experts module transformers decorates with `@use_experts_implementation` (its MoE
  architectures: Mixtral, Qwen2-MoE, GPT-OSS, OLMoE, GLM-4-MoE, ...) becomes a GroupedExperts
  (its layout flags, biases and own activation kept), which the MoE block transformers wrote
  calls as before: transformers' router, shared experts and output stay as they are.
- The tuned families' sparse MoE blocks become MoEBlocks whole: our router too (TopKRouter,
  MegaGate), which computes what theirs computes, and MegaMoE's shared-expert overlap.

Ours run as an experts implementation of transformers' own: EXPERTS_IMPLEMENTATION
("hyperparallel"), registered in `ALL_EXPERTS_FUNCTIONS` (so `experts_implementation=
"hyperparallel"` also runs our grouped products on a model nothing was swapped in), and set on the
swapped model. The swapped modules stand in for the classes they replaced (models/standins.py),
so transformers' own machinery still finds them: `output_router_logits` records our routers'
logits, `init_weights()` and `from_pretrained`'s missing keys initialize them with the family's
distributions, and `set_experts_implementation` reaches the experts: another implementation
transformers has ("eager", "grouped_mm", ...) then runs on the same Parameters, called through
transformers' interface, or is refused where it cannot run (under MXFP8 or expert parallelism).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

from hyperparallel.errors import ShapeError
from hyperparallel.moe import GroupedExperts, MoEBlock, TopKRouter
from hyperparallel.moe.experts import EXPERTS_IMPLEMENTATION, unsupported_reason

from .families import FAMILIES, all_moe_block_classes
from .standins import stand_in


def grouped_experts_forward(experts: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """EXPERTS_IMPLEMENTATION in transformers' experts interface: our grouped products on any
    `@use_experts_implementation` module (a GroupedExperts runs its own recipe and dispatcher)."""
    if not isinstance(experts, GroupedExperts):
        experts = _grouped_view(experts)
    return experts.routed(hidden_states, top_k_index, top_k_weights)


_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _grouped_view(experts: nn.Module) -> GroupedExperts:
    """A GroupedExperts over an HF experts module's own Parameters, made once per module (again
    where the module has been given other Parameters since: loaded, moved)."""
    view = _VIEWS.get(experts)
    if view is None or any(getattr(view, name) is not param for name, param in experts._parameters.items()):
        view = _VIEWS[experts] = GroupedExperts.from_hf(experts)
    view.train(experts.training)
    return view


ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)


def is_hf_experts(module: nn.Module) -> bool:
    """Whether `module` is an experts module of transformers' experts interface (its class
    decorated with `@use_experts_implementation`, which sets these on every instance)."""
    return hasattr(module, "_is_expert_parallel") and hasattr(module, "is_concatenated") \
        and not isinstance(module, GroupedExperts)


def experts_from_hf(experts: nn.Module) -> GroupedExperts:
    """The GroupedExperts standing in for one of transformers' experts modules; ShapeError with one
    line naming its class and what it does that ours cannot run."""
    reason = unsupported_reason(experts)
    if reason is not None:
        raise ShapeError(f"{type(experts).__name__} cannot run as hyperparallel's GroupedExperts: {reason}")
    return stand_in(GroupedExperts.from_hf(experts), experts)


def router_from_hf(router: nn.Module) -> TopKRouter:
    """Our TopKRouter holding a tuned family's router's weight (and correction bias) objects."""
    if isinstance(router, TopKRouter):
        return router
    rule = next((rule for f in FAMILIES.values() for name, rule in f.routers if name == type(router).__name__), None)
    if rule is None:
        raise TypeError(f"no tuned family's router is a {type(router).__name__}")
    options = rule(router)
    with torch.device("meta"):
        ours = TopKRouter(router.hidden_dim, router.num_experts, router.top_k, **options)
    ours.weight = router.weight
    if options.get("correction_bias"):
        ours.e_score_correction_bias = router.e_score_correction_bias
    if "hash_vocab_size" in options:
        ours.tid2eid = router.tid2eid
    return stand_in(ours, router)


def moe_block_from_hf(block: nn.Module) -> MoEBlock:
    """The MoEBlock for one of a tuned family's sparse MoE blocks (Qwen3-MoE, DeepSeek-V3, V4)."""
    modules = {}
    for name, child in block.named_children():  # in the HF block's order: a seed initializes alike
        if name == "gate":
            modules[name] = router_from_hf(child)
        elif name == "experts":
            modules[name] = child if isinstance(child, GroupedExperts) else experts_from_hf(child)
        elif name == "shared_experts":
            modules[name] = child
        else:
            raise NotImplementedError(f"{type(block).__name__}.{name}: MoEBlock has no place for it")
    return MoEBlock(modules)


def swap_moe_blocks(model: nn.Module) -> int:
    """Run every MoE layer of `model` on hyperparallel.moe's modules (a tuned family's blocks whole,
    any other `@use_experts_implementation` experts alone); return how many layers.

    Raises ShapeError (one line) for experts whose layout ours cannot run, and RuntimeError if any
    parameter or buffer changed object or name (a bug here, which would silently detach
    optimizers, tied weights and sharding from the model).
    """
    before = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    blocks = all_moe_block_classes()
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, blocks)]
    for name, module in targets:
        model.set_submodule(name, moe_block_from_hf(module))
    experts = [(name, m) for name, m in model.named_modules() if is_hf_experts(m)]
    swapped = {name: experts_from_hf(module) for name, module in experts}  # (every one checked before any is set)
    for name, module in swapped.items():
        model.set_submodule(name, module)
    if targets or experts:
        _run_ours(model)
    after = dict(model.named_parameters(remove_duplicate=False))
    lost = [name for name, param in before.items() if after.get(name) is not param]
    after_buffers = dict(model.named_buffers(remove_duplicate=False))
    lost += [name for name, buf in buffers.items() if after_buffers.get(name) is not buf]
    if lost or after.keys() != before.keys() or after_buffers.keys() != buffers.keys():
        raise RuntimeError(f"swap_moe_blocks changed parameters or buffers: {lost or sorted(after.keys() ^ before.keys())}")
    return len(targets) + len(experts)


def _run_ours(model: nn.Module) -> None:
    """Make EXPERTS_IMPLEMENTATION the model's experts implementation."""
    can_set = getattr(model, "_can_set_experts_implementation", None)
    if can_set is None or can_set():
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        return
    # transformers then runs its eager loop whatever is asked, and set_experts_implementation
    # refuses (a model class whose source it cannot read: defined in a notebook, say): ours keep
    # their grouped products instead of following the config to that loop
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.__dict__.pop("config", None)
