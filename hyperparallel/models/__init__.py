"""Hugging Face model families (each with its parallel plans as data): build (meta device, seeded
init, or a local checkpoint), MoE blocks swapped for hyperparallel.moe's, and training FLOPs per
token for MFU."""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build": ("build_model", "make_config", "pretrained_config"),
    "compile": ("compile_layers",),
    "families": (
        "FAMILIES",
        "ModelFamily",
        "all_experts_classes",
        "all_moe_block_classes",
        "all_router_classes",
        "family_for_model_type",
        "family_names",
        "get_family",
    ),
    "flops": ("training_flops_per_token",),
    "init": ("init_by_name", "init_weights", "module_seed"),
    "loss": ("FusedLossHead", "fused_loss", "install_fused_loss", "linear_cross_entropy"),
    "moe_blocks": ("moe_block_from_hf", "swap_moe_blocks"),
    "parallel_plan": ("TensorParallelPlan",),
})
