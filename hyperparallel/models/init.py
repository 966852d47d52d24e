"""Seeded initialization that does not depend on the layout: every module draws from a generator
seeded by the run's seed and the module's name, so a parameter's values are the same whether the
model is built whole in one process or sharded over 64 ranks.

`init_weights(model, seed)` initializes a model that has memory, in place. `init_by_name(shadow,
seed, write)` initializes a model built on the meta device (whole shapes, no memory) one module
at a time: it gives that module's own parameters and buffers memory, runs the family's init on
them, hands each tensor to `write(name, tensor)` (which keeps the part its rank holds) and frees
them again, so at most one module's tensors are ever whole at once. Both run the same per-module
init with the same seeds, so they give the same numbers (on one device type: CPU and CUDA
generators draw differently).

The per-module init is transformers' `_init_weights` in the order of its `initialize_weights`
(children first, each sub-model with its own): swapped-in routers and experts stand in for the
modules they replaced (models/standins.py), so the family's own code draws them; MXLinear gets
the draws transformers makes for the nn.Linear it replaced.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as hf_init

from hyperparallel.lowp import MXLinear
from hyperparallel.moe import GroupedExperts, TopKRouter
from hyperparallel.moe.router import hash_table

from .standins import stands_in


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module `name` (its qualified name in the model) in a run of `seed`."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # (torch seeds are below 2**64; keep it positive)


def modules_in_init_order(model: PreTrainedModel) -> Iterator[tuple[str, nn.Module, PreTrainedModel]]:
    """(name, module, the sub-model whose _init_weights applies) in transformers' init order:
    children before their parent."""

    def visit(prefix: str, module: nn.Module, owner: PreTrainedModel):
        for name, child in module.named_children():
            yield from visit(f"{prefix}{name}.", child, child if isinstance(child, PreTrainedModel) else owner)
        yield prefix.rstrip("."), module, owner

    yield from visit("", model, model)


def init_module(module: nn.Module, owner: PreTrainedModel) -> None:
    """Initialize `module`'s own parameters and buffers as its family does (under no_grad and
    transformers' init guard, from the current default generator)."""
    if isinstance(module, (GroupedExperts, TopKRouter)) and not stands_in(module):
        # built directly, not swapped in: the draws transformers makes for the modules they replace
        module.reset_parameters(std=owner.config.initializer_range)
    elif isinstance(module, MXLinear):  # transformers' init for nn.Linear, which MXLinear replaced
        module.weight.normal_(mean=0.0, std=owner.config.initializer_range)
        if module.bias is not None:
            module.bias.zero_()
    else:
        owner._init_weights(module)
        if isinstance(getattr(module, "tid2eid", None), torch.Tensor):
            # transformers zeroes DeepSeek-V4's hash table (it expects a checkpoint's): draw one, as
            # TopKRouter.reset_parameters does, so a seed gives the same model with or without the swap
            module.tid2eid.copy_(hash_table(*module.tid2eid.shape[:1], module.num_experts, module.top_k,
                                            device=module.tid2eid.device))


def _own_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*((n, p) for n, p in module._parameters.items() if p is not None),
            *((n, b) for n, b in module._buffers.items() if b is not None)]


def _seeded(seed: int, device: torch.device):
    fork_devices = [] if device.type == "cpu" else [device]
    return torch.random.fork_rng(devices=fork_devices, device_type=device.type if fork_devices else "cuda")


def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Initialize every parameter and buffer of `model` (which has memory) in place, each module
    from `module_seed(seed, its name)`. Independent of the global RNG (whose state is kept) and of
    how the model is laid out over ranks; GroupedExperts get the same draws as the HF experts
    module they replace, so a seed gives the same weights whether or not the experts were swapped."""
    device = next(model.parameters()).device
    _clear_initialized_marks(model)  # (loading marks what it filled; this re-initializes everything)
    with _seeded(seed, device), torch.no_grad(), hf_init.guard_torch_init_functions():
        for name, module, owner in modules_in_init_order(model):
            if _own_tensors(module):
                torch.manual_seed(module_seed(seed, name))
                init_module(module, owner)
    model.tie_weights()


def _clear_initialized_marks(model: nn.Module) -> None:
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        if "_is_hf_initialized" in obj.__dict__:
            del obj._is_hf_initialized


def init_by_name(shadow: PreTrainedModel, seed: int, write: Callable[[str, torch.Tensor], None], *,
                 wanted: Callable[[str], bool] | None = None, device: torch.device | str = "cpu") -> None:
    """Initialize a model built on the meta device one module at a time, handing out the values.

    For each module (in init order) that owns a parameter or buffer `wanted(name)` accepts (all
    by default), its own tensors get memory on `device`, are initialized exactly as
    `init_weights` would (same seed per module), go to `write(qualified name, tensor)`, and are
    put back on the meta device. A tied parameter is handed out under each name that holds it,
    each module's draw (`write` keeps the first, as init_weights' `tie_weights` does). `shadow`
    is left on the meta device (its ties undone: build another to use it as a model).
    """
    device = torch.device(device)
    with _seeded(seed, device), torch.no_grad(), hf_init.guard_torch_init_functions():
        for name, module, owner in modules_in_init_order(shadow):
            prefix = f"{name}." if name else ""
            own = [n for n, _ in _own_tensors(module)]
            if not own or (wanted is not None and not any(wanted(prefix + n) for n in own)):
                continue
            module.to_empty(device=device, recurse=False)
            torch.manual_seed(module_seed(seed, name))
            init_module(module, owner)
            for tensor_name, tensor in _own_tensors(module):
                if wanted is None or wanted(prefix + tensor_name):
                    write(prefix + tensor_name, tensor.detach())
            module.to_empty(device="meta", recurse=False)
