"""Parallelism plans and activation recompute: the device mesh, tensor / sequence parallelism,
context parallelism, expert parallelism, FSDP per decoder layer (docs/parallel.md)."""

from hyperparallel.parallel.context_attention import ring_attention, ulysses_attention
from hyperparallel.parallel.context_parallel import (
    ContextParallel,
    apply_context_parallel,
    context_parallel_batch,
    gather_sequence,
    load_balanced_positions,
    shard_sequence,
)
from hyperparallel.parallel.expert_parallel import ExpertLayout, apply_expert_parallel, expert_layout, expert_layout_of
from hyperparallel.parallel.fsdp_plan import shard_model
from hyperparallel.parallel.mesh import CP_MODES, MeshShape, ParallelMesh, build_mesh
from hyperparallel.parallel.recompute import MODES as RECOMPUTE_MODES
from hyperparallel.parallel.recompute import apply_recompute
from hyperparallel.parallel.tensor_parallel import (
    TensorParallelState,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    make_head_vocab_parallel,
    sync_partial_grads,
    tensor_parallel_state,
)

__all__ = [
    "CP_MODES",
    "RECOMPUTE_MODES",
    "ContextParallel",
    "ExpertLayout",
    "MeshShape",
    "ParallelMesh",
    "TensorParallelState",
    "VocabParallelEmbedding",
    "apply_context_parallel",
    "apply_expert_parallel",
    "apply_recompute",
    "apply_tensor_parallel",
    "build_mesh",
    "context_parallel_batch",
    "expert_layout",
    "expert_layout_of",
    "gather_sequence",
    "load_balanced_positions",
    "make_head_vocab_parallel",
    "ring_attention",
    "shard_model",
    "shard_sequence",
    "sync_partial_grads",
    "tensor_parallel_state",
    "ulysses_attention",
]
