"""DeepSeek-V4's decoder layers with MegaMHC: the hyper-connections as fused operations.

transformers' DeepseekV4DecoderLayer keeps `hc_mult` residual streams [B, S, N, D]. Around each of
its two blocks (attention, MoE) a DeepseekV4HyperConnection computes, from the streams, the
weights pre / post / comb (a projection, sigmoids, a softmax and 20 Sinkhorn iterations) and
collapses the streams into the block's input; after the block, its output is expanded back into
N streams and the old streams mixed in (post * out + comb^T @ streams). Left to eager PyTorch
that is some 60 small element-wise operations per hyper-connection, each keeping its inputs for
backward. `HyperConnectedLayer` runs the same layer with MegaMHC's two fused operations
(`hyperparallel.kernels.mega_mhc`): `mhc_pre` for the weights and the collapse, `mhc_post` for the
expansion and mix; `MegaHyperHead` does the final collapse before the model's norm.

The layer holds transformers' own attention, MoE block and norms, and the hyper-connections'
Parameters, under the same names: state dicts, checkpoints, FSDP's groups and optimizers see no
difference. Its forward is transformers' with the two fused operations in place of the modules.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4DecoderLayer, DeepseekV4HyperHead

from hyperparallel.kernels.mega_mhc import MegaHyperConnection, MegaHyperHead, mhc_post

_CHILDREN = ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm", "attn_hc", "ffn_hc")


class HyperConnectedLayer(GradientCheckpointingLayer):
    """A DeepseekV4DecoderLayer whose hyper-connections run as MegaMHC's fused operations."""

    def __init__(self, layer: DeepseekV4DecoderLayer):
        super().__init__()
        self.layer_idx = layer.layer_idx
        for name, child in layer.named_children():  # in transformers' order: state dicts keep theirs
            if name not in _CHILDREN:
                raise NotImplementedError(f"DeepseekV4DecoderLayer.{name}: HyperConnectedLayer has no place for it")
            if name in ("attn_hc", "ffn_hc") and not isinstance(child, MegaHyperConnection):
                child = MegaHyperConnection.from_hf(child)
            setattr(self, name, child)

    def forward(self, hidden_states: torch.Tensor, input_ids: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        post, comb, collapsed = self.attn_hc(hidden_states)
        attn_output, _ = self.self_attn(self.input_layernorm(collapsed), **kwargs)
        hidden_states = _expand_and_mix(attn_output, hidden_states, post, comb)
        post, comb, collapsed = self.ffn_hc(hidden_states)
        mlp_output = self.mlp(self.post_attention_layernorm(collapsed), input_ids=input_ids)
        return _expand_and_mix(mlp_output, hidden_states, post, comb)


def _expand_and_mix(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
                    comb: torch.Tensor) -> torch.Tensor:
    """post * block_out + comb^T @ streams, for [B, S, ...] tensors (mhc_post takes tokens flat)."""
    B, S, N, D = streams.shape
    mixed = mhc_post(block_out.reshape(B * S, D), streams.reshape(B * S, N, D), post.reshape(B * S, N),
                     comb.reshape(B * S, N, N))
    return mixed.view(B, S, N, D)


def use_mega_mhc(model: nn.Module) -> int:
    """Every DeepseekV4DecoderLayer of `model` as a HyperConnectedLayer, and its hyper-head as a
    MegaHyperHead; returns how many layers. Parameters keep their objects and names (checked)."""
    before = dict(model.named_parameters(remove_duplicate=False))
    targets = [(name, m) for name, m in model.named_modules() if isinstance(m, DeepseekV4DecoderLayer)]
    for name, layer in targets:
        model.set_submodule(name, HyperConnectedLayer(layer))
    heads = [(name, m) for name, m in model.named_modules() if isinstance(m, DeepseekV4HyperHead)]
    for name, head in heads:
        model.set_submodule(name, MegaHyperHead.from_hf(head))
    after = dict(model.named_parameters(remove_duplicate=False))
    lost = [name for name, param in before.items() if after.get(name) is not param]
    if lost or after.keys() != before.keys():
        raise RuntimeError(f"use_mega_mhc changed parameters: {lost or sorted(after.keys() ^ before.keys())}")
    return len(targets)
