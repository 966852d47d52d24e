"""Hugging Face model families: build (meta device, seeded init, or a local checkpoint), MoE
experts as grouped matmuls, and training FLOPs per token for MFU."""

from .build import build_model, init_weights, make_config, pretrained_config
from .compile import compile_layers
from .families import (
    FAMILIES,
    ModelFamily,
    all_experts_classes,
    all_router_classes,
    family_for_model_type,
    family_names,
    get_family,
)
from .flops import training_flops_per_token
from .grouped_experts import GroupedExperts, grouped_mm, native_grouped_mm_supported, swap_experts
from .loss import FusedLossHead, fused_loss, install_fused_loss, linear_cross_entropy

__all__ = [
    "FAMILIES",
    "FusedLossHead",
    "GroupedExperts",
    "ModelFamily",
    "all_experts_classes",
    "all_router_classes",
    "build_model",
    "compile_layers",
    "family_for_model_type",
    "family_names",
    "fused_loss",
    "get_family",
    "grouped_mm",
    "init_weights",
    "install_fused_loss",
    "linear_cross_entropy",
    "make_config",
    "native_grouped_mm_supported",
    "pretrained_config",
    "swap_experts",
    "training_flops_per_token",
]
