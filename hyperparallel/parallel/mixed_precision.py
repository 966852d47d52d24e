"""Which parameters a bf16 step computes from bf16 copies, and which FSDP gathers in what form.

[Note: bf16 parameters] Under `training.mixed_precision: bf16` the products run under
torch.autocast(bfloat16), which casts a float32 weight to bf16 as the product reads it. So FSDP
gathers those weights in bf16 (fsdp's MixedPrecision param_dtype): the same values autocast
would make, half the bytes. The products' parameters are the Linears' and Conv1D's weights and
biases (the fused loss's head included: its product runs in autocast's dtype), the embeddings'
tables and the experts' 3-D weights. Every other parameter keeps
float32 in its gathered copy (`fsdp.keep_param_dtype`): the norms' weights and the routers', and
whatever else a model reads in elementwise operations (attention sinks, DeepSeek-V4's
hyper-connection weights), which autocast leaves in float32 and which some models read in float32
on purpose (DeepSeek-V3's and Qwen3-MoE's routers compute their logits in float32; DeepSeek-V3's
report keeps the gating and the norms in higher precision for the same reason). They are a few
hundredths of a percent of a large model's weights (Qwen3-30B-A3B: 0.04%), so a gather carrying
its experts moves 0.5002x float32's bytes; where expert parallelism keeps each rank's experts
whole (no FSDP gather of them) the routers are 0.85% of what the gathers carry: 0.504x.

The embedding is the one product autocast does not cast (a lookup, not a product): gathered in
bf16, it hands out bf16-rounded rows. On every layout its output is rounded to bf16 and handed on
in the table's own dtype (`round_embedding_outputs`): the residual stream stays in float32 as
under autocast alone (the HF Trainer's bf16=True), the rows carry the rounding autocast gives
every other weight, and one process, DDP and FSDP compute the same forward. (PyTorch FSDP2's
default, cast_forward_inputs, would make the residual stream bf16 instead: a choice of the
model's numerics, not of the traffic, which this leaves as the model has it.)

Gradients reduce in `parallel.reduce_dtype` (float32 by default) and land in the float32 shards,
which the optimizer updates; a parameter's full gradient before the reduction is in its gathered
dtype (bf16 for the products), as in FSDP2.

MXFP8 layers (`lowp.MXLinear`, and MXFP8 experts' gate_up and down weights) gather their weights
as MX data instead (`attach_mx_gather`, lowp/gather.py): FP8 elements and E8M0 scales, 1.03
bytes per element, quantized by each rank from its float32 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.fsdp import keep_param_dtype, set_gather_codec
from hyperparallel.lowp import MXLinear
from hyperparallel.lowp.conversion import is_experts, is_mx_experts
from hyperparallel.models import FusedLossHead


def _is_product(module: nn.Module) -> bool:
    """A module whose parameters feed matrix products (or, for an embedding, a lookup of rows)."""
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, (nn.Linear, nn.Embedding, MXLinear, Conv1D, FusedLossHead)) or is_experts(module)


def keep_float32_outside_products(model: nn.Module) -> list[str]:
    """Tag every parameter that is not a product's to be gathered in its own dtype ([Note: bf16
    parameters]); returns their names. Call before sharding."""
    product = {id(p) for m in model.modules() if _is_product(m) for p in m.parameters(recurse=False)}
    kept = []
    for name, p in model.named_parameters():
        if id(p) not in product:
            keep_param_dtype(p)
            kept.append(name)
    return kept


def round_embedding_outputs(model: nn.Module, dtype: torch.dtype) -> None:
    """Every embedding's output rounded to `dtype` and handed on in its table's dtype: what an
    embedding gathered in `dtype` gives, on every layout (one process and DDP hold the table in
    float32), so that every layout computes the same forward ([Note: bf16 parameters])."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            table = module.weight.dtype

            def hook(mod, args, out, table=table):
                return out.to(dtype).to(table) if out.is_floating_point() else out

            module.register_forward_hook(hook)


def attach_mx_gather(model: nn.Module) -> int:
    """Let FSDP gather every MXLinear's weight and MXFP8 experts' two weights as MX data
    (lowp/gather.py); returns how many weights. Call before sharding: fsdp aligns each such
    weight's shards to whole blocks, or gathers its values where that would pad its slots by more
    than an eighth (fsdp/gather.py, codec_align)."""
    count = 0
    for module in model.modules():
        if isinstance(module, MXLinear):
            set_gather_codec(module.weight, module.gathered)
            count += 1
        elif is_mx_experts(module) and module.recipe.save_weight_copy:
            for name, codec in module.recipe.gathered.items():
                set_gather_codec(getattr(module, name), codec)
                count += 1
    return count
