"""Parallelism plans and activation recompute: the device mesh, tensor / sequence parallelism,
context parallelism, expert parallelism, FSDP per decoder layer (docs/parallel.md)."""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "context_attention": ("ring_attention", "ulysses_attention"),
    "context_parallel": (
        "ContextParallel",
        "apply_context_parallel",
        "context_parallel_batch",
        "gather_sequence",
        "load_balanced_positions",
        "shard_sequence",
    ),
    "expert_parallel": ("ExpertLayout", "apply_expert_parallel", "expert_layout", "expert_layout_of"),
    "fsdp_plan": ("shard_model",),
    "mesh": ("CP_MODES", "PP_SCHEDULES", "MeshShape", "ParallelMesh", "build_mesh"),
    "recompute": ("RECOMPUTE_MODES", "apply_recompute"),
    "tensor_parallel": (
        "TensorParallelState",
        "apply_tensor_parallel",
        "make_head_vocab_parallel",
        "sync_partial_grads",
        "tensor_parallel_state",
    ),
})
