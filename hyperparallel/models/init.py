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

[Note: inits beyond a module's own tensors] Two things a module-at-a-time init would miss are
found first, by running every module's init once on the meta device and recording which tensors
it writes (`InitPlan.of`):
- a module whose `_init_weights` writes other modules' tensors (GPT-2's attention rescales its
  c_proj, AFMoE's MoE block zeroes its gate, Falcon-H1's model writes every layer's mup_vector):
  it is initialized together with those modules, they first, as transformers does (only those:
  the rest of its subtree keeps its own turn, so a rank never holds more than it needs at once);
- a tensor no `_init_weights` writes (a value its module's constructor sets: Apertus' xIELU
  activation's alphas, OpenAI GPT's Conv1D weights), which building on the meta device loses: it
  takes the values of its module built anew on the CPU by its constructor (with the arguments the
  module keeps under their names, or with the model's config).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import PreTrainedModel
from transformers import initialization as hf_init

from hyperparallel.errors import ConfigError
from hyperparallel.lowp import MXLinear
from hyperparallel.moe import GroupedExperts, TopKRouter
from hyperparallel.moe.router import hash_table

from .standins import stands_in


def module_seed(seed: int, name: str) -> int:
    """The generator seed of module `name` (its qualified name in the model) in a run of `seed`."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1  # (torch seeds are below 2**64; keep it positive)


def modules_in_init_order(model: nn.Module, prefix: str = "", owner: PreTrainedModel | None = None
                          ) -> Iterator[tuple[str, nn.Module, PreTrainedModel]]:
    """(name, module, the sub-model whose _init_weights applies) in transformers' init order:
    children before their parent. `model` may be a module inside `owner` named `prefix`."""

    def visit(name: str, module: nn.Module, owner: PreTrainedModel):
        for child_name, child in module.named_children():
            yield from visit(f"{name}.{child_name}" if name else child_name, child,
                             child if isinstance(child, PreTrainedModel) else owner)
        yield name, module, owner

    yield from visit(prefix, model, owner if owner is not None else model)


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


def _storage(tensor: torch.Tensor) -> int:
    """A tensor's storage, by which its views and `.data` are the same tensor (on the meta device too)."""
    return tensor.untyped_storage()._cdata


class _Written(TorchDispatchMode):
    """Records the storages an init writes in place (a view's, `weight[padding_idx]`, and `.data`'s
    are their tensor's)."""

    def __init__(self):
        super().__init__()
        self.ids: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable and args and isinstance(args[0], torch.Tensor):
            self.ids.add(_storage(args[0]))
        return func(*args, **(kwargs or {}))


# torch.nn.init's functions that return at once on the meta device (nothing to sample), whose
# writes `InitPlan.of` would not see
_SKIPPED_ON_META = ("trunc_normal_", "orthogonal_", "sparse_", "dirac_")


@contextlib.contextmanager
def _writes_seen_on_meta():
    """transformers' init functions (which `guard_torch_init_functions` routes torch's to) write
    the tensor in place for those, on the meta device too: the values do not matter there, the
    write does."""
    saved = {name: hf_init.TORCH_INIT_FUNCTIONS[name] for name in _SKIPPED_ON_META}
    try:
        for name in _SKIPPED_ON_META:
            hf_init.TORCH_INIT_FUNCTIONS[name] = lambda tensor, *args, **kwargs: tensor.zero_()
        yield
    finally:
        hf_init.TORCH_INIT_FUNCTIONS.update(saved)


@dataclass
class InitPlan:
    """What a per-module init must do beyond each module's own tensors ([Note: inits beyond a
    module's own tensors])."""

    # module -> the other modules whose tensors its init writes (initialized together with it)
    together: dict[str, set[str]] = field(default_factory=dict)
    constructed: dict[str, list[str]] = field(default_factory=dict)  # module -> own tensors no init writes

    @classmethod
    def of(cls, model: PreTrainedModel) -> InitPlan:
        """Every module's init run once on `model` (on the meta device, where it writes nothing)."""
        plan, everything = cls(), _Written()
        owners: dict[int, set[str]] = {}  # a storage -> the modules holding it (a tied weight: several)
        for name, module in model.named_modules(remove_duplicate=False):
            for _, tensor in _own_tensors(module):
                owners.setdefault(_storage(tensor), set()).add(name)
        with torch.no_grad(), hf_init.guard_torch_init_functions(), _writes_seen_on_meta():
            for name, module, owner in modules_in_init_order(model):
                this = _Written()
                with this:
                    init_module(module, owner)
                everything.ids |= this.ids
                others = {holder for written in this.ids for holder in owners.get(written, ()) if holder != name}
                if others:
                    plan.together[name] = others
        for name, module in model.named_modules():
            missing = [n for n, t in _own_tensors(module) if _storage(t) not in everything.ids]
            if missing:
                plan.constructed[name] = missing
        return plan

    def groups(self, order: list[str]) -> dict[str, list[str]]:
        """The modules initialized at each module's turn (`order`: every module's name in init
        order): those whose inits write one another's tensors (tied weights too), in init order,
        at the turn of the last of them; a module alone at its own; none at the others'."""
        root = {name: name for name in order}

        def find(name: str) -> str:
            while root[name] != name:
                name = root[name]
            return name

        for name, others in self.together.items():
            for other in others:
                root[find(other)] = find(name)
        members: dict[str, list[str]] = {}
        for name in order:
            members.setdefault(find(name), []).append(name)
        return {group[-1]: group for group in members.values()}


def _constructed(module: nn.Module, names: list[str], owner: PreTrainedModel, where: str) -> None:
    """Copy into `module`'s tensors `names` the values its constructor gives them (a module of
    its class built anew on the CPU: with no arguments, or with the model's config)."""
    config = owner.config
    for args, kwargs in ((), _own_arguments(module)), ((config,), {}), ((config.get_text_config(decoder=True),), {}):
        try:
            with torch.device("cpu"):
                fresh = type(module)(*args, **kwargs)
        except Exception:  # noqa: BLE001, S112 (another constructor's signature: try the next)
            continue
        values = dict(_own_tensors(fresh))
        if all(n in values and values[n].shape == getattr(module, n).shape for n in names):
            for n in names:
                getattr(module, n).copy_(values[n])
            return
    raise ConfigError(f"{where}.{names[0]} ({type(module).__name__}): transformers' _init_weights leaves it to its "
                      f"module's constructor, which cannot be rebuilt alone; give model.path with its weights")


def _own_arguments(module: nn.Module) -> dict:
    """The constructor's arguments that `module` keeps under their own names (Conv1D's nf and nx),
    those without a default; empty where one is not kept (the constructor then runs as it is)."""
    try:
        parameters = inspect.signature(type(module).__init__).parameters
    except (TypeError, ValueError):
        return {}
    required = [p.name for p in list(parameters.values())[1:]
                if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not all(hasattr(module, name) for name in required):
        return {}
    return {name: getattr(module, name) for name in required}


def _init_subtree(name: str, module: nn.Module, owner: PreTrainedModel, seed: int, plan: InitPlan) -> None:
    """`module` (named `name`, inside `owner`) and its descendants, each from its own seed,
    children first (with memory)."""
    for full, child, child_owner in modules_in_init_order(module, name, owner):
        if _own_tensors(child) or full in plan.together:
            torch.manual_seed(module_seed(seed, full))
            init_module(child, child_owner)
        if full in plan.constructed:
            _constructed(child, plan.constructed[full], child_owner, full)


def init_weights(model: PreTrainedModel, seed: int) -> None:
    """Initialize every parameter and buffer of `model` (which has memory) in place, each module
    from `module_seed(seed, its name)`. Independent of the global RNG (whose state is kept) and of
    how the model is laid out over ranks; GroupedExperts get the same draws as the HF experts
    module they replace, so a seed gives the same weights whether or not the experts were swapped."""
    device = next(model.parameters()).device
    _clear_initialized_marks(model)  # (loading marks what it filled; this re-initializes everything)
    with _seeded(seed, device):  # (the global RNG as it was: the probe draws too)
        plan = InitPlan.of(_meta_copy(model))
    with _seeded(seed, device), torch.no_grad(), hf_init.guard_torch_init_functions():
        _init_subtree("", model, model, seed, plan)
    model.tie_weights()


def _meta_copy(model: nn.Module) -> nn.Module:
    """`model` with its parameters and buffers on the meta device (tied ones still tied): where
    `InitPlan.of` probes the inits without writing memory."""
    memo: dict[int, torch.Tensor] = {}
    tensors = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    for _, tensor in tensors:
        if id(tensor) not in memo:
            meta = tensor.detach().to("meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


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
    put back on the meta device; modules whose inits write one another's tensors (a parent its
    child's) together, in init order (`InitPlan.groups`). A tied parameter is handed out under
    each name that holds it, each module's draw (`write` keeps the first, as init_weights'
    `tie_weights` does). `shadow` is left as it was, on the meta device.
    """
    device = torch.device(device)
    with _seeded(seed, device):
        plan = InitPlan.of(shadow)
    order = list(modules_in_init_order(shadow))
    turns = plan.groups([name for name, _, _ in order])
    entries = {name: (name, module, owner) for name, module, owner in order}
    with _seeded(seed, device), torch.no_grad(), hf_init.guard_torch_init_functions():
        for name, _, _ in order:
            group = [entries[member] for member in turns.get(name, ())]  # (in init order)
            tensors = [(f"{sub}.{n}" if sub else n, t) for sub, m, _ in group for n, t in _own_tensors(m)]
            if not tensors or (wanted is not None and not any(wanted(n) for n, _ in tensors)):
                continue
            on_meta = _materialize([m for _, m, _ in group], device)
            for sub, m, sub_owner in group:
                torch.manual_seed(module_seed(seed, sub))
                init_module(m, sub_owner)
                if sub in plan.constructed:
                    _constructed(m, plan.constructed[sub], sub_owner, sub)
            for sub, m, _ in group:
                for tensor_name, tensor in _own_tensors(m):
                    full = f"{sub}.{tensor_name}" if sub else tensor_name
                    if wanted is None or wanted(full):
                        write(full, tensor.detach())
            for store, key, tensor in on_meta:  # (the shadow as it was)
                store[key] = tensor


def _materialize(modules: list[nn.Module], device: torch.device) -> list[tuple[dict, str, torch.Tensor]]:
    """Give the modules' own tensors memory on `device`, each its own (a tied weight is each
    module's draw: the caller's `write` keeps the first, as the whole model's tie_weights does);
    returns (dict, key, the tensor it held) to put back."""
    put_back = []
    for module in modules:
        for store in (module._parameters, module._buffers):
            for key, tensor in store.items():
                if tensor is not None:
                    put_back.append((store, key, tensor))
                    new = torch.empty_like(tensor, device=device)
                    store[key] = nn.Parameter(new, requires_grad=tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else new
    return put_back


def init_non_persistent_buffers(model: PreTrainedModel, meta: PreTrainedModel) -> None:
    """Compute `model`'s non-persistent buffers (the rotary frequencies: in no checkpoint) as its
    init does: its `_init_weights`, or its module's constructor where no init writes one (`meta`:
    the same model on the meta device, whose init is planned: `InitPlan`)."""
    plan = InitPlan.of(meta)
    with torch.no_grad(), hf_init.guard_torch_init_functions():
        for name, module, owner in modules_in_init_order(model):
            if not module._non_persistent_buffers_set:
                continue
            init_module(module, owner)
            left = [n for n in plan.constructed.get(name, []) if n in module._non_persistent_buffers_set]
            if left:
                _constructed(module, left, owner, name)
