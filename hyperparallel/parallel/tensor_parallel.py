"""Tensor parallelism (TP) with optional sequence parallelism (SP) for the Hugging Face families.

Each rank keeps the same Parameter objects holding only its part (`.data` replaced), as expert
parallelism does, so that everything after it works on plain local tensors: MXFP8 converts
the TP-local linears, FSDP shards the TP-local weights over the data-parallel ranks (uneven
shards as ever), and checkpoints record each part's place in the global tensor.

The plans are the families' data: each entry in models/families.py names its attention's and
MLP's modules and their placements (models/parallel_plan.py's TensorParallelPlan; docs/parallel.md
has them as tables), and this file applies them, knowing no family:

- column-parallel over heads (or kv heads, or an MLP's width): each rank keeps its heads' rows;
  with fewer key/value heads than tp, each rank holds the one key/value head its query heads
  use (replicated over tp / kv ranks).
- row-parallel: each rank keeps its heads' (or width's) input columns; its output is partial.
- replicated inside the block (q_norm, the MLA a-projections): whole, with a partial gradient.
- routed experts: not split by TP (expert parallelism splits them); the router replicated.
- in every family the embedding and the output head vocab-parallel, the loss vocab-parallel
  (`vocab_loss.VocabShard`): logits are never whole on any rank.

Communication sits at the attention / MLP boundaries (`tp_collectives`): without SP the residual
stream is whole on every TP rank, each block's input enters as is and its output is all-reduced;
with SP the residual stream, the norms and the MoE layers run on this rank's part of the
sequence, a block's input is all-gathered and its output reduce-scattered.

Gradients: a TP-split weight's gradient is exact on its rank. A replicated weight that works on
every rank's part of a computation gets a partial gradient that is summed over the TP group
after backward (`sync_partial_grads`, partial_grads.py: one all-reduce per dtype): the weights
inside an attention or MLP block (q_norm, the MLA a-projections), and with SP every replicated
weight (norms, routers, experts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import ShardInfo, set_column_shards, set_shard_info
from hyperparallel.models.loss import FusedLossHead
from hyperparallel.models.parallel_plan import Heads, Modules, TensorParallelPlan
from hyperparallel.parallel.partial_grads import PartialGradSum
from hyperparallel.parallel.recompute import decoder_layers
from hyperparallel.parallel.tp_collectives import enter_tp, exit_tp, reduce_tp, split_sequence
from hyperparallel.parallel.vocab_loss import VocabShard

TP_STATE = "_hp_tensor_parallel"


@dataclass
class TensorParallelState:
    """What TP did to a model, by parameter name (the names survive FSDP and checkpoints)."""

    group: dist.ProcessGroup
    tp: int
    rank: int
    sequence_parallel: bool
    columns: dict[str, tuple[int, int]] = field(default_factory=dict)  # row-parallel: (global columns, first column)
    # names whose gradient is partial on each rank: None sums over the whole group; (slot, slots)
    # sums over the ranks sharing slot `slot` (a replicated key/value head)
    partial: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)  # TP ranks holding the same values (default: tp)
    plan: list[tuple[str, str]] = field(default_factory=list)  # (module, placement), for the run summary and docs
    partial_sum: PartialGradSum | None = field(default=None, repr=False, compare=False)  # made by the first sync_partial_grads

    def replicas_of(self, name: str) -> int:
        return self.replicas.get(name, self.tp)


def tensor_parallel_state(model: nn.Module) -> TensorParallelState | None:
    return getattr(model, TP_STATE, None)


# ----------------------------------------------------------------------------- splitting weights


def _parts(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ConfigError(f"parallel.tp ({tp}) must divide {what} ({total})")
    return total // tp


def _keep_rows(linear: nn.Module, start: int, count: int) -> None:
    for name in ("weight", "bias"):
        param = getattr(linear, name, None)
        if param is None:
            continue
        global_shape = param.shape
        param.data = param.data[start:start + count].clone()
        set_shard_info(param, ShardInfo(global_shape, start, count))  # FSDP shards within it; checkpoints place it
    linear.out_features = count


def _keep_columns(linear: nn.Module, start: int, count: int) -> tuple[int, int]:
    if getattr(linear, "bias", None) is not None:
        raise ConfigError(f"tensor parallelism: a row-parallel projection with a bias ({type(linear).__name__}) "
                          f"would add the bias on every TP rank; this plan supports bias-free ones")
    weight = linear.weight
    global_columns = weight.shape[1]
    weight.data = weight.data[:, start:start + count].clone()
    linear.in_features = count
    return global_columns, start


class _Planner:
    def __init__(self, model: nn.Module, state: TensorParallelState):
        self.model, self.state = model, state
        self.names: dict[int, list[str]] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(id(p), []).append(n)

    def record(self, table: dict, param: nn.Parameter, value) -> None:
        """table[name] = value under every name of `param` (a tied weight has two)."""
        for name in self.names[id(param)]:
            table[name] = value

    def column(self, linear: nn.Module, parts: int, part_size: int, owner: str, what: str,
               slot: tuple[int, int] | None = None) -> None:
        """Keep rows [part x part_size) of `linear`'s output for this rank's part."""
        state = self.state
        index = slot[0] if slot is not None else state.rank
        per_rank = parts // (state.tp if slot is None else slot[1])
        _keep_rows(linear, index * per_rank * part_size, per_rank * part_size)
        for p in (linear.weight, getattr(linear, "bias", None)):
            if p is None:
                continue
            if slot is not None:
                self.record(state.partial, p, slot)
                self.record(state.replicas, p, state.tp // slot[1])
            else:
                self.record(state.replicas, p, 1)
        state.plan.append((owner, what))

    def row(self, linear: nn.Module, parts: int, part_size: int, owner: str, what: str) -> None:
        state = self.state
        per_rank = parts // state.tp
        self.record(state.columns, linear.weight,
                    _keep_columns(linear, state.rank * per_rank * part_size, per_rank * part_size))
        self.record(state.replicas, linear.weight, 1)
        state.plan.append((owner, what))

    def replicated_inside(self, module: nn.Module | None, owner: str) -> None:
        """Replicated weights inside a TP block: each rank's gradient covers its part only."""
        if module is None:
            return
        for p in module.parameters():
            self.record(self.state.partial, p, None)
        self.state.plan.append((owner, "replicated (gradient summed over tp)"))


def _hook_block(module: nn.Module, group: dist.ProcessGroup, sp: bool) -> None:
    """The block's input enters the TP region (whole on every rank), its output leaves it."""

    def before(mod, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = enter_tp(kwargs["hidden_states"], group, sp)
        else:
            args = (enter_tp(args[0], group, sp), *args[1:])
        return args, kwargs

    def after(mod, args, kwargs, output):
        if isinstance(output, tuple):
            return (exit_tp(output[0], group, sp), *output[1:])
        return exit_tp(output, group, sp)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def _find(block: nn.Module, names: str) -> tuple[str, nn.Module | None]:
    """The module a plan's name picks in `block` ("a|b": a if the block holds one, else b) and its
    name; None if the block holds none of them."""
    for name in names.split("|"):
        child = getattr(block, name, None)
        if child is not None:
            return name, child
    return names, None


def _head_parts(heads: Heads, config, tp: int, rank: int) -> tuple[int, tuple[int, int] | None]:
    """How many `heads` the model has, and this rank's slot among them ((slot, slots)) when tp
    exceeds them, None when tp divides them."""
    count = getattr(config, heads.config_key)
    if count % tp == 0:
        return count, None
    if heads.shared and tp % count == 0:
        # each rank's query heads use one of these heads: the rank holds that one, replicated over
        # the tp / count ranks whose query heads share it (their gradients are summed among them)
        return count, (rank * count // tp, count)
    if heads.shared:
        raise ConfigError(f"parallel.tp ({tp}) and {heads.noun} ({heads.config_key} = {count}): one must divide "
                          f"the other")
    raise ConfigError(f"parallel.tp ({tp}) must divide {heads.noun} ({heads.config_key} = {count})")


def _plan_block(planner: _Planner, block: nn.Module, modules: Modules, config, owner: str) -> bool:
    """Split `block`'s modules as the family's plan places them; True if this rank holds a shared
    head (one key/value head of fewer than tp)."""
    state = planner.state
    shared = False
    for names, placement in modules:
        name, child = _find(block, names)
        where = f"{owner}.{name}"
        if placement.style == "replicated":
            planner.replicated_inside(child, where)
            continue
        if child is None:
            raise ConfigError(f"parallel.tp: no tensor-parallel plan for {owner} ({type(block).__name__}): the "
                              f"family's plan splits its {names.replace('|', ' or ')}, which it does not have")
        heads = placement.heads
        if heads is None:  # an MLP's width: one row (column-parallel) or input column (row-parallel) a part
            parts = child.weight.shape[0 if placement.style == "column" else 1]
            _parts(parts, state.tp, f"{owner}'s intermediate size")
            part_size, slot, what = 1, None, f"{placement.style}-parallel"
        else:
            parts, slot = _head_parts(heads, config, state.tp, state.rank)
            part_size = sum(getattr(block, size) for size in placement.head_size)
            what = (f"{placement.style}-parallel over {heads.label}s" if slot is None
                    else f"{heads.label} replicated over {state.tp // parts} ranks")
        if placement.style == "column":
            planner.column(child, parts, part_size, where, what, slot=slot)
        elif slot is None:
            planner.row(child, parts, part_size, where, what)
        else:
            raise AssertionError(f"{where}: a row-parallel projection over shared heads (the planner has no such split)")
        shared |= slot is not None
    return shared


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows [start, start + rows) are on this rank: ids elsewhere give zeros,
    and the ranks' results are summed (each id's row is on exactly one rank)."""

    def __init__(self, embedding: nn.Embedding, group: dist.ProcessGroup, start: int):
        super().__init__()
        self.weight = embedding.weight  # the same Parameter (already this rank's rows)
        self.group, self.start = group, start
        self.num_embeddings, self.embedding_dim = self.weight.shape
        padding = embedding.padding_idx
        self.padding_idx = padding - start if padding is not None and 0 <= padding - start < self.num_embeddings else None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        rows = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        return reduce_tp(rows.masked_fill(outside.unsqueeze(-1), 0), self.group)

    def extra_repr(self) -> str:
        return f"rows {self.start}..{self.start + self.num_embeddings} of a vocab-parallel embedding, {self.embedding_dim}"


def _plan_vocab(planner: _Planner, model: nn.Module) -> None:
    state = planner.state
    inner = getattr(model, "model", model)
    embedding = getattr(inner, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    if not isinstance(embedding, nn.Embedding) or not isinstance(head, nn.Linear | FusedLossHead):
        raise ConfigError(f"parallel.tp: {type(model).__name__} has no model.embed_tokens embedding and lm_head "
                          f"linear to make vocab-parallel")
    vocab = embedding.weight.shape[0]
    per_rank = _parts(vocab, state.tp, "the vocabulary (vocab_size; pad it to a multiple of tp)")
    start = state.rank * per_rank
    tied = head.weight is embedding.weight  # (tied: one Parameter, split once)
    _keep_rows(head, start, per_rank)
    if not tied:
        _keep_rows(embedding, start, per_rank)
    embedding.num_embeddings = per_rank
    for p in (embedding.weight, head.weight):
        planner.record(state.replicas, p, 1)
    inner.embed_tokens = VocabParallelEmbedding(embedding, state.group, start)
    state.plan.append(("model.embed_tokens", "vocab-parallel (rows), outputs summed over tp"))
    state.plan.append(("lm_head", "vocab-parallel (rows), vocab-parallel cross-entropy"))


def _family_plan(model: nn.Module) -> TensorParallelPlan:
    """The tensor-parallel plan of `model`'s family (its entry in models/families.py, found by the
    config's model_type)."""
    from hyperparallel.models.families import family_for_model_type

    model_type = getattr(model.config, "model_type", None)
    family = family_for_model_type(model_type)
    if family is None or family.tensor_parallel is None:
        whose = f"family {family.name!r}" if family is not None else f"{type(model).__name__} (model_type {model_type!r})"
        raise ConfigError(f"parallel.tp: {whose} has no tensor-parallel plan; use FSDP (dp_shard) and EP")
    return family.tensor_parallel


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup, *, sequence_parallel: bool,
                          plan: TensorParallelPlan | None = None) -> TensorParallelState:
    """Split `model`'s weights over the TP `group` as `plan` (default: its family's) places them
    and put the collectives in its forward and backward. Call right after building the model,
    before MXFP8 conversion, expert parallelism, the fused loss (`make_head_vocab_parallel` after
    it), recompute and FSDP."""
    from hyperparallel.moe import MoEBlock

    plan = plan or _family_plan(model)
    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    state = TensorParallelState(group, tp, rank, sequence_parallel)
    planner = _Planner(model, state)
    config = model.config
    with torch.no_grad():
        _plan_vocab(planner, model)
        layers = decoder_layers(model)
        for i, layer in enumerate(layers):
            owner = f"model.layers.{i}"
            attention, at = getattr(layer, plan.attention_at), f"{owner}.{plan.attention_at}"
            if _plan_block(planner, attention, plan.attention, config, at) and plan.kv_groups:
                setattr(attention, plan.kv_groups, 1)  # one local key/value head serves all local query heads
            _hook_block(attention, group, sequence_parallel)
            mlp, at = getattr(layer, plan.mlp_at), f"{owner}.{plan.mlp_at}"
            if isinstance(mlp, MoEBlock):  # (the swap made every family's MoE layers MoEBlocks)
                shared = getattr(mlp, plan.shared_experts) if plan.shared_experts else None
                if shared is not None:
                    _plan_block(planner, shared, plan.mlp, config, f"{at}.{plan.shared_experts}")
                    _hook_block(shared, group, sequence_parallel)
                state.plan.append((f"{at}.experts", "replicated over tp (expert parallelism splits them)"))
            else:
                _plan_block(planner, mlp, plan.mlp, config, at)
                _hook_block(mlp, group, sequence_parallel)
    if sequence_parallel:
        # the residual stream from the first layer on is this rank's part of the sequence: every
        # replicated weight then sees only those tokens
        layers[0].register_forward_pre_hook(_split_first_input(group), with_kwargs=True)
        for name, _ in model.named_parameters(remove_duplicate=False):
            if name not in state.replicas:
                state.partial.setdefault(name, None)
    setattr(model, TP_STATE, state)
    set_column_shards(model, state.columns)  # where checkpoints place them
    return state


def _split_first_input(group: dist.ProcessGroup):
    def before(mod, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = split_sequence(kwargs["hidden_states"], group)
        else:
            args = (split_sequence(args[0], group), *args[1:])
        return args, kwargs

    return before


def make_head_vocab_parallel(model: nn.Module) -> None:
    """The fused loss head of a TP model computes the vocab-parallel loss (its weight is already
    this rank's rows); without a fused loss head the logits would be whole: refused."""
    state = tensor_parallel_state(model)
    head = getattr(model, "lm_head", None)
    if not isinstance(head, FusedLossHead):
        raise ConfigError("parallel.tp needs training.fused_loss: true (the vocab-parallel loss computes the "
                          "cross-entropy without whole logits on any rank)")
    vocab = model.get_input_embeddings()
    head.vocab_shard = VocabShard(state.group, vocab.start)
    head.out_features = head.weight.shape[0]

    def before(mod, args):
        return (enter_tp(args[0], state.group, state.sequence_parallel),)

    head.register_forward_pre_hook(before)


def sync_partial_grads(model: nn.Module) -> None:
    """Sum over the TP group the gradients that are partial on each rank (after backward, before
    clipping): one all-reduce per dtype and device for all of them, replicated key/value weights
    included (partial_grads.py). Which parameters those are is found on the first call and kept
    while the model holds the same Parameter objects."""
    state = tensor_parallel_state(model)
    if state is None or not state.partial:
        return
    if state.partial_sum is None or not state.partial_sum():
        state.partial_sum = PartialGradSum.of(model, state.partial, state.group)
        state.partial_sum()


def grad_replicas(model: nn.Module) -> dict[str, int] | None:
    """Per parameter name, how many TP ranks hold the same gradient (for the global norm)."""
    state = tensor_parallel_state(model)
    if state is None:
        return None
    return {name: state.replicas_of(name) for name, _ in model.named_parameters()}
