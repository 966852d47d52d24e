"""Tensor parallelism (TP) with optional sequence parallelism (SP) for any Hugging Face causal LM,
from the plan its model declares: transformers' own (`base_model_tp_plan`, the model's `_tp_plan`),
or a tuned family's additions to it, handed in as data (`plan`: module name pattern -> style).

Each rank keeps the same Parameter objects holding only its part (`.data` replaced), as expert
parallelism does, so that everything after it works on plain local tensors: MXFP8 converts
the TP-local linears, FSDP shards the TP-local weights over the data-parallel ranks (uneven
shards as ever), and checkpoints record each part's place in the global tensor.

transformers' styles, as this file runs them (docs/parallel.md, "The plans"):
- colwise: the projection's output rows are dealt out over the TP ranks a part at a time: a head's
  rows in an attention module (with fewer key/value heads than tp, each rank holds the one its
  query heads use, replicated over tp / kv ranks), one row of an MLP's width; its bias likewise.
- rowwise: its input columns, likewise; each rank's output is a partial sum, which the block's
  exit sums over tp (a bias is added once, after the sum).
- replicated_with_grad_allreduce, mla_kv_a_proj, and whatever a block holds that the plan does
  not split: whole on every rank inside the block, working on this rank's part of it: the
  gradient is partial and summed over tp after backward.
- colwise_gather_output, rowwise_split_input (a packed projection whose parts are not
  head-contiguous: Phi-3's qkv_proj): whole on every rank, computed in full by each.
- embedding_rowwise and the output head: vocab-parallel in every model, the loss vocab-parallel
  (`vocab_loss.VocabShard`): logits are never whole on any rank.
- the routed experts (moe_tp_experts, grouped_gemm and their parameters' entries): not split by
  TP (expert parallelism splits them); routers replicated.
Any other style on a decoder layer's module is refused, naming the module and the style.

A block is the module whose children the plan splits (an attention module, an MLP, a MoE layer's
shared experts): communication sits at its boundaries (`tp_collectives`): without SP the residual
stream is whole on every TP rank, each block's input enters as is and its output is all-reduced;
with SP the residual stream, the norms and the MoE layers run on this rank's part of the
sequence, a block's input is all-gathered and its output reduce-scattered.

Gradients: a TP-split weight's gradient is exact on its rank. A replicated weight that works on
every rank's part of a computation gets a partial gradient that is summed over the TP group
after backward (`sync_partial_grads`, partial_grads.py: one all-reduce per dtype): the weights
inside a block (q_norm, the MLA a-projections), and with SP every replicated weight (norms,
routers, experts).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.fsdp import ShardInfo, set_column_shards, set_shard_info
from hyperparallel.models.layers import (
    SEQUENCE_MIXERS,
    attention_modules,
    config_value,
    config_values,
    decoder_layer_names,
    layer_config,
    text_config,
)
from hyperparallel.models.loss import FusedLossHead
from hyperparallel.moe import GroupedExperts
from hyperparallel.parallel.partial_grads import PartialGradSum
from hyperparallel.parallel.pipeline import HeldByLastStage, StageInput
from hyperparallel.parallel.tp_collectives import enter_tp, exit_tp, reduce_tp, split_sequence
from hyperparallel.parallel.vocab_loss import VocabShard

# transformers' plan styles -> how this file runs them (the module docstring)
STYLES = {
    "colwise": "column",
    "rowwise": "row",
    "replicated_with_grad_allreduce": "replicated",
    "mla_kv_a_proj": "replicated",
    "colwise_gather_output": "whole",
    "colwise_rep": "whole",
    "rowwise_split_input": "whole",
    "rowwise_rep": "whole",
    "local_params": "whole",  # (marks a module whose bare parameters have entries of their own)
    "moe_tp_experts": "experts",
    "grouped_gemm": "experts",
    "ep_dispatch_experts": "experts",
    "moe_identity_expert": "experts",
    "embedding_rowwise": "vocab",
}
TP_STATE = "_hp_tensor_parallel"


@dataclass
class TensorParallelState:
    """What TP did to a model, by parameter name (the names survive FSDP and checkpoints)."""

    tp: int
    rank: int
    sequence_parallel: bool
    columns: dict[str, tuple[int, int]] = field(default_factory=dict)  # row-parallel: (global columns, first column)
    # names whose gradient is partial on each rank: None sums over the whole group; (slot, slots)
    # sums over the ranks sharing slot `slot` (a replicated key/value head)
    partial: dict[str, tuple[int, int] | None] = field(default_factory=dict)
    replicas: dict[str, int] = field(default_factory=dict)  # TP ranks holding the same values (default: tp)
    plan: list[tuple[str, str]] = field(default_factory=list)  # (module, placement), for the run summary and docs
    # the blocks (module names) whose input enters the TP region and whose output leaves it, with
    # their row-parallel projections that carry a bias (names within the block)
    blocks: dict[str, list[str]] = field(default_factory=dict)
    vocab_start: int = 0  # the first row of the vocabulary this rank holds (the embedding's and the head's)
    # the TP group its collectives run over (apply_tensor_parallel's); None where only the weights were
    # split (split_tensor_parallel: `hyperparallel plan`'s one-rank model, which runs no collective)
    group: dist.ProcessGroup | None = None
    partial_sum: PartialGradSum | None = field(default=None, repr=False, compare=False)  # made by the first sync_partial_grads

    def replicas_of(self, name: str) -> int:
        return self.replicas.get(name, self.tp)


def tensor_parallel_state(model: nn.Module) -> TensorParallelState | None:
    return getattr(model, TP_STATE, None)


# ----------------------------------------------------------------------------- the plan, resolved


@dataclass(frozen=True)
class Split:
    """One module (or bare parameter) of a decoder layer and how TP places it."""

    name: str  # its qualified name in the model
    how: str  # a value of STYLES
    block: str  # the module whose input enters the TP region and whose output leaves it


def _pattern(key: str) -> re.Pattern:
    """A plan key ("model.layers.*.self_attn.q_proj") as a regex of qualified names ('*': a layer index)."""
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


def resolve_plan(model: nn.Module, plan: dict[str, str]) -> list[Split]:
    """The decoder layers' modules `plan` places, in the model's order; ConfigError (one line,
    naming the module and the style) for what this file does not run."""
    layers = decoder_layer_names(model)
    patterns = [(key, _pattern(key), style) for key, style in plan.items()]
    modules = dict(model.named_modules())
    params = dict(model.named_parameters(remove_duplicate=False))
    inside_experts = {name for name, m in modules.items() if isinstance(m, GroupedExperts)}
    splits, whole = [], set()
    for name in [*modules, *params]:
        if not any(name.startswith(f"{layer}.") for layer in layers):
            continue
        style = next((style for key, pattern, style in patterns if pattern.fullmatch(name)), None)
        if style is None:
            continue
        how = STYLES.get(style)
        owner = name.rsplit(".", 1)[0]
        if how == "experts" or name in inside_experts or owner in inside_experts:
            continue  # (expert parallelism splits the routed experts)
        if how is None or how == "vocab":
            raise ConfigError(f"parallel.tp: the tensor-parallel plan puts {name} as {style!r}, which hyperparallel's "
                              f"tensor parallelism does not run")
        if how == "whole":
            whole.add(style)
            continue
        if owner in layers:
            raise ConfigError(f"parallel.tp: the plan splits {name}, which the decoder layer holds directly: its "
                              f"output joins the residual stream, where a partial sum cannot be completed")
        splits.append(Split(name, how, owner))
    rows: dict[str, list[str]] = {}
    for split in splits:
        if split.how == "row":
            rows.setdefault(split.block, []).append(split.name)
    for block, names in rows.items():
        if len(names) > 1:  # (Doge's attention: a row-parallel dt_proj whose partial sums it reads)
            raise ConfigError(f"parallel.tp: the tensor-parallel plan splits {' and '.join(names)} by rows: only a "
                              f"block's output projection can be row-parallel (its partial sums are completed as "
                              f"they leave {block})")
    if not rows:
        styles = f" (its decoder layers' entries are {' / '.join(sorted(whole))}, whole outputs on every rank)" \
            if whole else " (transformers' plan covers only the embedding and the experts, or nothing)"
        raise ConfigError(f"parallel.tp: the tensor-parallel plan splits no row-parallel projection in the decoder "
                          f"layers{styles}; use FSDP (dp_shard) and EP")
    # a block is what one row-parallel projection's partial sums leave complete: a column split
    # elsewhere would leave its block's output split, and a block inside another would be summed twice
    for split in splits:
        if split.how == "column" and split.block not in rows:
            raise ConfigError(f"parallel.tp: the tensor-parallel plan splits {split.name} by columns and nothing in "
                              f"{split.block} by rows, so its output would stay split over the ranks")
    nested = next((inner for inner in rows for outer in rows if inner.startswith(f"{outer}.")), None)
    if nested is not None:
        raise ConfigError(f"parallel.tp: the tensor-parallel plan splits {rows[nested][0]} by rows inside a block that "
                          f"is split too; only one of them can complete its partial sums")
    # (a replicated entry outside a split block: its module runs whole on every rank, as unplanned)
    return [split for split in splits if split.block in rows]


def plan_problem(model: nn.Module, plan: dict[str, str] | None, tp: int, *,
                 sequence_parallel: bool = False) -> str | None:
    """Why `model` (on the meta device is enough) cannot run `plan` over `tp` ranks, or None."""
    if plan is None:
        return "it has no tensor-parallel plan (transformers declares none for it)"
    try:
        splits = resolve_plan(model, plan)
        for split in splits:
            if split.how != "replicated":
                _Heads.of(model, split, tp, rank=0)
        if sequence_parallel:
            _check_sequence_parallel(model, {split.block for split in splits})
    except ConfigError as error:
        return str(error).removeprefix("parallel.tp: ")
    return None


def _check_sequence_parallel(model: nn.Module, blocks: set[str]) -> None:
    """Sequence parallelism gives the split blocks the whole sequence and everything else this
    rank's part of it: whatever mixes tokens must be inside a split block."""
    mixing = {id(m) for m in attention_modules(model)}
    layers = decoder_layer_names(model)
    for name, module in model.named_modules():
        if not any(name.startswith(f"{layer}.") for layer in layers):
            continue
        if id(module) in mixing or SEQUENCE_MIXERS.search(type(module).__name__) or isinstance(module, nn.modules.conv._ConvNd):
            if not any(name == block or name.startswith(f"{block}.") for block in blocks):
                raise ConfigError(f"parallel.sequence_parallel: {name} ({type(module).__name__}) mixes tokens outside "
                                  f"the blocks the tensor-parallel plan splits, where each rank holds only its part "
                                  f"of the sequence; set sequence_parallel: false")


@dataclass(frozen=True)
class _Heads:
    """How a split projection's rows (column) or columns (row) are dealt out: `parts` of `size`,
    this rank's `slot` of `slots` when it holds one key/value head shared by tp / parts ranks."""

    parts: int
    size: int
    slot: tuple[int, int] | None = None

    @classmethod
    def of(cls, model: nn.Module, split: Split, tp: int, rank: int) -> _Heads:
        module = _module_or_param_owner(model, split.name)
        weight = module if isinstance(module, nn.Parameter) else module.weight
        width = weight.shape[1] if split.how == "row" else weight.shape[0]
        block = model.get_submodule(split.block)
        config = _block_config(model, block)
        heads, kv_heads = _head_counts(block, config)
        if _is_attention(block) and heads:
            # a query-like projection holds every head at one of the block's head sizes (or one value
            # per query head: attention sinks); a key- or value-like one (grouped-query attention) the
            # key/value heads
            per_head, sizes = width // heads, _head_sizes(block, config)
            sinks = weight.ndim == 1 and width == heads
            if width % heads == 0 and (kv_heads == heads or per_head in sizes or sinks or width % kv_heads):
                if heads % tp:
                    raise ConfigError(f"parallel.tp ({tp}) must divide the attention heads (num_attention_heads = "
                                      f"{heads}) that {split.name} holds")
                return cls(heads, per_head)
            if width % kv_heads == 0:
                return cls._kv(split, kv_heads, width // kv_heads, tp, rank)
        if width % tp:
            raise ConfigError(f"parallel.tp ({tp}) must divide {split.name}'s width ({width})")
        return cls(width, 1)

    @classmethod
    def _kv(cls, split: Split, kv_heads: int, head_dim: int, tp: int, rank: int) -> _Heads:
        if kv_heads % tp == 0:
            return cls(kv_heads, head_dim)
        if tp % kv_heads == 0 and split.how == "column":
            # each rank's query heads use one of these heads: the rank holds that one, replicated over
            # the tp / kv_heads ranks whose query heads share it (their gradients summed among them)
            return cls(kv_heads, head_dim, (rank * kv_heads // tp, kv_heads))
        raise ConfigError(f"parallel.tp ({tp}) and the key/value heads of {split.name} (num_key_value_heads = "
                          f"{kv_heads}): one must divide the other")


def _head_counts(block: nn.Module, config) -> tuple[int | None, int | None]:
    """(query heads, key/value heads) of an attention module: its own where it says (a layer may
    have a key/value head count of its own: MiMo-V2-Flash's sliding layers), else the config's."""
    heads = next((v for v in (getattr(block, a, None) for a in ("num_heads", "num_attention_heads"))
                  if isinstance(v, int)), None) or config_value(config, "num_attention_heads")
    groups = getattr(block, "num_key_value_groups", None)
    if isinstance(groups, int) and heads and groups > 0 and heads % groups == 0:
        return heads, heads // groups
    return heads, config_value(config, "num_key_value_heads") or heads


def _head_sizes(block: nn.Module, config) -> set[int]:
    """Every head size the block or the config names (head_dim, v_head_dim, qk_head_dim, ...)."""
    return {value for owner in (block, config) for name in dir(owner) if name.endswith("head_dim")
            and not name.startswith("_") for value in config_values(owner, name) if isinstance(value, int)}


def _block_config(model: nn.Module, block: nn.Module):
    """The config of the decoder layer `block` belongs to: its own where transformers' config lets
    the layers differ (per_layer_config, by the block's layer_idx), else the model's."""
    return layer_config(text_config(model), getattr(block, "layer_idx", None))


def _is_attention(block: nn.Module) -> bool:
    return any(hasattr(block, attr) for attr in ("head_dim", "num_key_value_groups", "num_heads")) \
        or type(block).__name__.endswith("Attention")


def _module_or_param_owner(model: nn.Module, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return model.get_parameter(name)


# ----------------------------------------------------------------------------- splitting weights


def _keep_rows(param: nn.Parameter, start: int, count: int) -> None:
    """Keep rows [start, start + count) of dim 0."""
    global_shape = param.shape
    param.data = param.data[start:start + count].clone()
    set_shard_info(param, ShardInfo(global_shape, start, count))  # FSDP shards within it; checkpoints place it


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

    def split(self, split: Split) -> _Heads | None:
        """Keep this rank's part of one module; how its heads were dealt (None: kept whole)."""
        state = self.state
        target = _module_or_param_owner(self.model, split.name)
        if split.how == "replicated":
            for p in [target] if isinstance(target, nn.Parameter) else target.parameters():
                self.record(state.partial, p, None)
            state.plan.append((split.name, "replicated (gradient summed over tp)"))
            return None
        heads = _Heads.of(self.model, split, state.tp, state.rank)
        index = heads.slot[0] if heads.slot is not None else state.rank
        per_rank = heads.parts // (state.tp if heads.slot is None else heads.slot[1])
        start, count = index * per_rank * heads.size, per_rank * heads.size
        if split.how == "column":
            params = [target] if isinstance(target, nn.Parameter) else [target.weight, getattr(target, "bias", None)]
            for p in params:
                if p is not None:
                    _keep_rows(p, start, count)
                    if heads.slot is not None:
                        self.record(state.partial, p, heads.slot)
                    self.record(state.replicas, p, 1 if heads.slot is None else state.tp // heads.slot[1])
            if not isinstance(target, nn.Parameter):
                target.out_features = target.weight.shape[0]
        else:  # row
            weight = target.weight
            self.record(state.columns, weight, (weight.shape[1], start))
            weight.data = weight.data[:, start:start + count].clone()
            target.in_features = count
            self.record(state.replicas, weight, 1)
            if getattr(target, "bias", None) is not None:
                # whole on every rank and added once after the sum (`_hook_block`): its gradient is the
                # whole output's on every rank, with sequence parallelism too (exit_tp's backward
                # gathers it), so it is not partial
                self.record(state.replicas, target.bias, state.tp)
        state.plan.append((split.name, f"{split.how}-parallel" + (" over heads" if heads.size > 1 else "")
                           if heads.slot is None else f"key/value head replicated over {state.tp // heads.slot[1]} ranks"))
        return heads


def _hook_block(module: nn.Module, group: dist.ProcessGroup, sp: bool, biased: list[str]) -> None:
    """The block's input enters the TP region (whole on every rank), its output leaves it. `biased`:
    its row-parallel projections (names within it) whose bias every rank added: once after the sum."""
    tp = dist.get_world_size(group)

    def before(mod, args, kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = enter_tp(kwargs["hidden_states"], group, sp)
        else:
            args = (enter_tp(args[0], group, sp), *args[1:])
        return args, kwargs

    def leave(output):
        output = exit_tp(output, group, sp)
        for name in biased:  # (each rank's partial sum carried the bias: tp - 1 of them too many; looked up
            # here, where the block's parameters are gathered, and its modules are what convert left)
            output = output - (tp - 1) * module.get_submodule(name).bias.detach()
        return output

    def after(mod, args, kwargs, output):
        if isinstance(output, tuple):
            return (leave(output[0]), *output[1:])
        return leave(output)

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, with_kwargs=True)


def make_embedding_vocab_parallel(embedding: nn.Embedding, group: dist.ProcessGroup, start: int) -> None:
    """`embedding` (holding this rank's rows [start, start + num_embeddings) already) looks up ids
    in its own rows: ids elsewhere read row 0 and give zeros, and the ranks' results are summed
    (each id's row is on exactly one rank). Its own forward runs (a scaled embedding's scale
    included: Gemma's), its class and parameter names stay; hooks do the rest."""
    rows = embedding.num_embeddings
    outside_of: list[torch.Tensor] = []  # the forward's ids outside this rank's rows (pre-hook to hook)

    def before(module, args, kwargs):
        ids = args[0] if args else kwargs.pop("input")
        local = ids - start
        outside = (local < 0) | (local >= rows)
        outside_of.append(outside)
        return (local.masked_fill(outside, 0), *args[1:]), kwargs

    def after(module, args, kwargs, output):
        return reduce_tp(output.masked_fill(outside_of.pop().unsqueeze(-1), 0), group)

    embedding.register_forward_pre_hook(before, with_kwargs=True)
    embedding.register_forward_hook(after, with_kwargs=True)


def _plan_vocab(planner: _Planner, model: nn.Module) -> None:
    state = planner.state
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    # (a pipeline stage holds the embedding, the head, both or neither: the others' places stand in)
    has_embedding, has_head = isinstance(embedding, nn.Embedding), isinstance(head, nn.Linear | FusedLossHead)
    if not (has_embedding or isinstance(embedding, StageInput)) or not (has_head or isinstance(head, HeldByLastStage)):
        raise ConfigError(f"parallel.tp: {type(model).__name__} has no input embedding and linear output head to make "
                          f"vocab-parallel")
    if not (has_embedding or has_head):
        return
    vocab = (embedding if has_embedding else head).weight.shape[0]
    if vocab % state.tp:
        raise ConfigError(f"parallel.tp ({state.tp}) must divide the vocabulary ({vocab}; pad vocab_size to a multiple "
                          f"of tp)")
    per_rank = vocab // state.tp
    start = state.vocab_start = state.rank * per_rank
    tied = has_head and has_embedding and head.weight is embedding.weight  # (tied: one Parameter, split once)
    names = {id(m): n for n, m in model.named_modules()}
    if has_head:
        _keep_rows(head.weight, start, per_rank)
        head.out_features = per_rank
        planner.record(state.replicas, head.weight, 1)
        state.plan.append((names[id(head)], "vocab-parallel (rows), vocab-parallel cross-entropy"))
    if has_embedding:
        if not tied:
            _keep_rows(embedding.weight, start, per_rank)
        embedding.num_embeddings = per_rank
        padding = embedding.padding_idx  # (its row, where this rank holds it)
        embedding.padding_idx = padding - start if padding is not None and 0 <= padding - start < per_rank else None
        planner.record(state.replicas, embedding.weight, 1)
        state.plan.append((names[id(embedding)], "vocab-parallel (rows), outputs summed over tp"))


def _local_head_counts(block: nn.Module, config, tp: int, kv_shared: bool) -> None:
    """An attention module whose heads TP split: the counts its forward reads, made this rank's."""
    heads, kv_heads = _head_counts(block, config)
    local, local_kv = heads // tp, 1 if kv_shared else max(kv_heads // tp, 1)
    counts = {"num_heads": local, "num_attention_heads": local, "num_key_value_heads": local_kv,
              "num_kv_heads": local_kv, "num_key_value_groups": local // local_kv}
    for attr, value in counts.items():
        if isinstance(getattr(block, attr, None), int):
            setattr(block, attr, value)


def split_tensor_parallel(model: nn.Module, plan: dict[str, str], tp: int, rank: int, *,
                          sequence_parallel: bool) -> TensorParallelState:
    """Keep TP rank `rank`'s part (of `tp`) of `model`'s weights as `plan` places them, and make its
    attention modules count their local heads: the weights alone, no collectives (the model runs as
    one rank's part would, which is what `hyperparallel plan` measures; `apply_tensor_parallel` adds
    the collectives)."""
    state = TensorParallelState(tp, rank, sequence_parallel)
    planner = _Planner(model, state)
    splits = resolve_plan(model, plan)
    if sequence_parallel:
        _check_sequence_parallel(model, {split.block for split in splits})
    config = text_config(model)
    with torch.no_grad():
        _plan_vocab(planner, model)
        shared_kv: dict[str, bool] = {}
        for split in splits:
            heads = planner.split(split)
            biased = state.blocks.setdefault(split.block, [])
            shared_kv[split.block] = shared_kv.get(split.block, False) or (heads is not None and heads.slot is not None)
            target = _module_or_param_owner(model, split.name)
            if split.how == "row" and getattr(target, "bias", None) is not None:
                biased.append(split.name.removeprefix(f"{split.block}."))
        for name in state.blocks:
            block = model.get_submodule(name)
            if _is_attention(block) and config_values(config, "num_attention_heads"):
                _local_head_counts(block, _block_config(model, block), tp, shared_kv[name])
            # whatever the plan leaves whole inside a block works on this rank's part of it: its
            # gradient is partial (q_norm, an MLA's low-rank a-projections and their norms, named by
            # a plan or not)
            for p in block.parameters():
                if not any(n in state.replicas or n in state.partial for n in planner.names[id(p)]):
                    planner.record(state.partial, p, None)
    if sequence_parallel:
        # the residual stream from the first layer on is this rank's part of the sequence: every
        # replicated weight then sees only those tokens
        for name, _ in model.named_parameters(remove_duplicate=False):
            if name not in state.replicas:
                state.partial.setdefault(name, None)
    setattr(model, TP_STATE, state)
    return state


def apply_tensor_parallel(model: nn.Module, group: dist.ProcessGroup, *, sequence_parallel: bool,
                          plan: dict[str, str]) -> TensorParallelState:
    """Split `model`'s weights over the TP `group` as `plan` (transformers' style names by module
    name pattern: `models.families.tensor_parallel_plan`) places them and put the collectives in
    its forward and backward. Call right after building the model, before MXFP8 conversion, expert
    parallelism, the fused loss (`make_head_vocab_parallel` after it), recompute and FSDP."""
    state = split_tensor_parallel(model, plan, dist.get_world_size(group), dist.get_rank(group),
                                  sequence_parallel=sequence_parallel)
    state.group = group
    if isinstance(model.get_input_embeddings(), nn.Embedding):  # (not on a later pipeline stage)
        make_embedding_vocab_parallel(model.get_input_embeddings(), group, state.vocab_start)
    for name, biased in state.blocks.items():
        _hook_block(model.get_submodule(name), group, sequence_parallel, biased)
    if sequence_parallel:
        first = model.get_submodule(decoder_layer_names(model)[0])
        first.register_forward_pre_hook(_split_first_input(group), with_kwargs=True)
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
    if isinstance(head, HeldByLastStage):  # (a pipeline stage before the last: no head here)
        return
    if not isinstance(head, FusedLossHead):
        raise ConfigError("parallel.tp needs training.fused_loss: true (the vocab-parallel loss computes the "
                          "cross-entropy without whole logits on any rank)")
    head.vocab_shard = VocabShard(state.group, state.vocab_start)
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
