"""A family's tensor-parallel plan: data that its entry in families.py declares and
`hyperparallel.parallel.tensor_parallel` applies (docs/parallel.md, "The plans").

As torchtitan's model specs bring their own parallelize plans, a family's entry says which of its
modules tensor parallelism splits and how; the code that splits them knows no family, so a new
family's plan is a new entry. A plan gives, for the decoder layer's attention and for its MLP
(and a MoE layer's shared experts), each module's placement:

- column-parallel: the projection's output rows are dealt out over the TP ranks a part at a time
  (a head's rows, or one row of an MLP's width); each rank computes its heads' outputs.
- row-parallel: its input columns, likewise; each rank's output is a partial sum, which the
  block's exit sums over tp.
- replicated inside the block: whole on every rank, but working on this rank's part of the block,
  so its gradient is partial and is summed over tp after backward.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Heads:
    """A count of heads in the model's config, which tensor parallelism deals out over its ranks."""

    config_key: str  # the config field that counts them
    label: str  # one of them, as the run summary's plan names it: "column-parallel over kv heads"
    noun: str  # all of them, as errors name them: "parallel.tp (8) must divide the attention heads (...)"
    # True: tp may also be a multiple of the count. Each rank then holds the one head its query heads
    # use, replicated over the tp / count ranks whose query heads share it (their gradients summed
    # among them); False: tp must divide the count.
    shared: bool = False


HEADS = Heads("num_attention_heads", "head", "the attention heads")
KV_HEADS = Heads("num_key_value_heads", "kv head", "the key/value heads", shared=True)


@dataclass(frozen=True)
class Placement:
    """How tensor parallelism splits one module of a block."""

    style: str  # "column", "row" or "replicated"
    heads: Heads | None = None  # the parts dealt out; None: an MLP's width, one row (or column) a part
    head_size: tuple[str, ...] = ()  # the block's attributes whose sum is one head's rows (or columns)


def column(heads: Heads | None = None, *head_size: str) -> Placement:
    return Placement("column", heads, head_size)


def row(heads: Heads | None = None, *head_size: str) -> Placement:
    return Placement("row", heads, head_size)


REPLICATED = Placement("replicated")  # a block that lacks the module (or holds None) has nothing to replicate

# A block's modules and their placements, in the order the plan splits them (the run summary's
# order). "a|b" names alternatives, a choice of the config within one family: the first the block
# holds (not None) is split; DeepSeek's attention has q_b_proj with a query LoRA, q_proj without.
Modules = tuple[tuple[str, Placement], ...]

# gate and up column-parallel over the width, down row-parallel: each rank's SwiGLU on its columns
SWIGLU_MLP: Modules = (("gate_proj", column()), ("up_proj", column()), ("down_proj", row()))


@dataclass(frozen=True)
class TensorParallelPlan:
    """Where a family's decoder layers split over tensor parallelism. The embedding and the output
    head are vocab-parallel in every family, and a MoE layer's routed experts and router are left
    whole by TP (expert parallelism splits the experts)."""

    attention: Modules  # the decoder layer's attention block
    mlp: Modules = SWIGLU_MLP  # a dense layer's MLP, and a MoE layer's shared experts
    attention_at: str = "self_attn"  # the decoder layer's attribute holding the attention
    mlp_at: str = "mlp"  # the decoder layer's attribute holding the MLP, or in a MoE layer its MoEBlock
    shared_experts: str | None = None  # the MoEBlock's shared experts (split as `mlp`); None: it has none
    # the attention's count of query heads per key/value head, by which transformers' attention
    # repeats its key/value heads: 1 where a rank holds one shared key/value head (its query heads
    # all use that one)
    kv_groups: str | None = None
