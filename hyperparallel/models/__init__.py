"""Hugging Face causal LMs: every text decoder-only type of transformers as a family (the four
tuned ones as overlays with their parallel plans as data), build (meta device, seeded init, or a
local checkpoint), MoE layers swapped for hyperparallel.moe's, decoder layers found from the model,
and training FLOPs per token for MFU."""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "build": ("build_model", "make_config", "pretrained_config"),
    "compile": ("compile_layers",),
    "families": (
        "FAMILIES",
        "ModelFamily",
        "all_moe_block_classes",
        "family_for_model_type",
        "family_names",
        "get_family",
    ),
    "flops": ("training_flops_per_token",),
    "init": ("init_by_name", "init_weights", "module_seed"),
    "loss": ("FusedLossHead", "fused_loss", "fused_loss_problem", "install_fused_loss", "linear_cross_entropy"),
    "layers": ("decoder_layers", "document_mask_problem"),
    "moe_blocks": ("moe_block_from_hf", "router_from_hf", "swap_moe_blocks"),
})
