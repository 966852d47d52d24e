"""Hugging Face model families: build (meta device, seeded init, or a local checkpoint), MoE
blocks swapped for hyperparallel.moe's, and training FLOPs per token for MFU."""

from .build import build_model, init_weights, make_config, pretrained_config
from .compile import compile_layers
from .families import (
    FAMILIES,
    ModelFamily,
    all_experts_classes,
    all_moe_block_classes,
    all_router_classes,
    family_for_model_type,
    family_names,
    get_family,
)
from .flops import training_flops_per_token
from .loss import FusedLossHead, fused_loss, install_fused_loss, linear_cross_entropy
from .moe_blocks import moe_block_from_hf, swap_moe_blocks

__all__ = [
    "FAMILIES",
    "FusedLossHead",
    "ModelFamily",
    "all_experts_classes",
    "all_moe_block_classes",
    "all_router_classes",
    "build_model",
    "compile_layers",
    "family_for_model_type",
    "family_names",
    "fused_loss",
    "get_family",
    "init_weights",
    "install_fused_loss",
    "linear_cross_entropy",
    "make_config",
    "moe_block_from_hf",
    "pretrained_config",
    "swap_moe_blocks",
    "training_flops_per_token",
]
