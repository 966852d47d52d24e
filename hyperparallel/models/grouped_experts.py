"""MoE experts as two grouped matmuls instead of a Python loop over experts.

`GroupedExperts` takes the place of a Hugging Face experts module (Qwen3MoeExperts,
DeepseekV3Experts) and adopts its Parameter objects under the same names, so state dicts,
checkpoints and optimizers see no difference. Its forward sorts the (token, slot) pairs by expert,
runs every expert's gate_up projection as one grouped matmul and every down projection as another,
then weights the rows and adds them back to their tokens.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from ..errors import ShapeError
from .families import all_experts_classes

# torch._grouped_mm on the CPU (torch 2.13) takes these dtypes, and needs every non-unit stride of
# its operands and of its result to be a multiple of 16 bytes.
_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_NATIVE_ALIGN_BYTES = 16


def native_grouped_mm_supported(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `grouped_mm(a, b, ...)` runs on torch._grouped_mm (else on the padded-bmm fallback).

    The rule: torch has `_grouped_mm`; a and b share a dtype among float32, bfloat16, float16 (on
    CUDA: bfloat16 only, and compute capability 8.0 or newer); b is row-major [E,K,N] or the
    transpose of a row-major [E,N,K] (how experts store their weights); K and N (a.shape[1],
    b.shape[2]) times the element size are multiples of 16 bytes, so that a (made contiguous), b,
    the result and both gradients have 16-byte-aligned strides.
    """
    if not hasattr(torch, "_grouped_mm") or a.dtype != b.dtype or a.dtype not in _NATIVE_DTYPES:
        return False
    if a.device.type == "cuda":
        # Measured on the CPU only; on CUDA keep to what the kernels are known to serve.
        if a.dtype != torch.bfloat16 or torch.cuda.get_device_capability(a.device) < (8, 0):
            return False
    elif a.device.type != "cpu":
        return False
    if not (b.is_contiguous() or b.transpose(-2, -1).is_contiguous()):
        return False
    k, n = b.shape[1], b.shape[2]
    size = a.element_size()
    return (k * size) % _NATIVE_ALIGN_BYTES == 0 and (n * size) % _NATIVE_ALIGN_BYTES == 0


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype matmuls on `x` run in: torch.autocast's for x's device when it is on, else x's own."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and x.is_floating_point():
        return torch.get_autocast_dtype(device)
    return x.dtype


# Rows per padded group for bf16/fp16 grouped matmuls on the CPU: oneDNN builds (and caches) one
# kernel per matmul shape, so expert groups of new sizes every step cost ~1 ms each there (measured:
# bf16 [M,256]x[256,512] with M varying is 5x slower than with M fixed). 32 rows bound the shapes
# to a few dozen per projection at a cost of at most 31 zero rows per expert.
_CPU_LOW_PRECISION_GROUP_ALIGN = 32


def _group_alignment(device: torch.device, dtype: torch.dtype) -> int:
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
        return _CPU_LOW_PRECISION_GROUP_ALIGN
    return 1


def _has_values(t: torch.Tensor) -> bool:
    return t.device.type != "meta" and not isinstance(t, FakeTensor)


def _padded_slots(token_of_row, expert_of_row, offsets, num_tokens: int, align: int):
    """Lay the expert-sorted rows out in groups padded to multiples of `align`.

    Returns token_of_slot (the token each padded slot reads, `num_tokens` for a pad slot, which
    reads a zero row), row_slot (the slot of each sorted row) and the padded group ends. Eagerly
    the layout is as long as the padded groups need (one host sync, free on the CPU); under
    torch.compile it has the fixed length of the worst case (every group `align - 1` rows short),
    the last group taking the slack, so the graph has static shapes and no break. So it has on
    tensors without values (meta, or the fake tensors `hyperparallel plan` runs a model on).
    """
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    padded_counts = (counts + align - 1) // align * align
    padded_ends = torch.cumsum(padded_counts, 0)
    starts, padded_starts = offsets.long() - counts, padded_ends - padded_counts
    row_slot = torch.arange(token_of_row.shape[0], device=token_of_row.device) - starts[expert_of_row] \
        + padded_starts[expert_of_row]
    if torch.compiler.is_compiling() or not _has_values(offsets):
        rows, groups = token_of_row.shape[0], offsets.shape[0]
        total = (rows + groups * (align - 1) + align - 1) // align * align
        if groups:
            padded_ends = torch.cat([padded_ends[:-1], padded_ends.new_full((1,), total)])
    else:
        total = int(padded_ends[-1]) if padded_ends.numel() else 0
    token_of_slot = torch.full((total,), num_tokens, dtype=token_of_row.dtype, device=token_of_row.device)
    token_of_slot[row_slot] = token_of_row
    return token_of_slot, row_slot, padded_ends.to(torch.int32)


# torch._grouped_mm as custom ops: torch.compile sees them as opaque calls with a known output
# shape (its own meta function for _grouped_mm refuses float32), and the backward below runs on
# grouped matmuls too. torch's own backward for _grouped_mm fails on the CPU when the incoming
# gradient has zero or unaligned strides (an expanded gradient, as `.sum()` makes), so gradients
# are made contiguous here; the weight gradient is produced directly in the weight's own memory
# layout so that accumulating it into `.grad` needs no copy.
@torch.library.custom_op("hyperparallel::grouped_mm", mutates_args=())
def _grouped_mm_op(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a.contiguous(), b, offs=offsets)


@_grouped_mm_op.register_fake
def _(a, b, offsets):
    return a.new_empty(a.shape[0], b.shape[2])


@torch.library.custom_op("hyperparallel::grouped_mm_weight_grad", mutates_args=())
def _grouped_mm_weight_grad(a: torch.Tensor, grad_out: torch.Tensor, offsets: torch.Tensor,
                            transposed: bool) -> torch.Tensor:
    """Per group a^T grad_out: [E, K, N], or its transpose [E, N, K] (contiguous) when `transposed`."""
    a, grad_out = a.contiguous(), grad_out.contiguous()
    if transposed:
        return torch._grouped_mm(grad_out.t(), a, offs=offsets)
    return torch._grouped_mm(a.t(), grad_out, offs=offsets)


@_grouped_mm_weight_grad.register_fake
def _(a, grad_out, offsets, transposed):
    k, n = a.shape[1], grad_out.shape[1]
    return a.new_empty(offsets.shape[0], *((n, k) if transposed else (k, n)))


def _grouped_mm_setup(ctx, inputs, output):
    a, b, offsets = inputs
    ctx.save_for_backward(a, b, offsets)


def _grouped_mm_backward(ctx, grad_out):
    a, b, offsets = ctx.saved_tensors
    grad_out = grad_out.contiguous()
    grad_a = grad_b = None
    if ctx.needs_input_grad[0]:
        grad_a = _grouped_mm_op(grad_out, b.transpose(-2, -1), offsets)
    if ctx.needs_input_grad[1]:
        transposed = b.transpose(-2, -1).is_contiguous()  # b is an [E,N,K] weight seen as [E,K,N]
        grad_b = _grouped_mm_weight_grad(a, grad_out, offsets, transposed)
        if transposed:
            grad_b = grad_b.transpose(-2, -1)
    return grad_a, grad_b, None


_grouped_mm_op.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_setup)


def _padded_bmm_grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Reference and fallback: scatter the groups into [E, max_rows, K], one bmm, gather back.

    Costs E * max_rows * K memory, so a badly balanced routing costs more than a balanced one;
    autograd works through the index ops and the bmm as they are.
    """
    num_groups, rows = b.shape[0], a.shape[0]
    counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1, dtype=torch.long))
    group = torch.repeat_interleave(torch.arange(num_groups, device=a.device), counts, output_size=rows)
    row_in_group = torch.arange(rows, device=a.device) - (offsets.long() - counts)[group]
    max_rows = int(counts.max()) if num_groups else 0  # one host sync; the native path has none
    padded = a.new_zeros(num_groups, max_rows, a.shape[1]).index_put((group, row_in_group), a)
    return torch.bmm(padded, b)[group, row_in_group]


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """a [M,K] x b [E,K,N] -> [M,N]: rows offsets[g-1]:offsets[g] of a are multiplied by b[g].

    `offsets` holds cumulative group ends (1-D, int32, length E, last == M); empty groups are
    allowed. Runs torch._grouped_mm when `native_grouped_mm_supported(a, b)`, else a padded bmm;
    both are differentiable in a and b and neither loops over groups in Python.
    """
    if a.dim() != 2 or b.dim() != 3 or a.shape[1] != b.shape[1]:
        raise ShapeError(f"grouped_mm needs a [M,K] and b [E,K,N]; got a {tuple(a.shape)} and b {tuple(b.shape)}")
    if offsets.dim() != 1 or offsets.shape[0] != b.shape[0]:
        raise ShapeError(
            f"grouped_mm needs offsets of shape [{b.shape[0]}] (one end per group); got {tuple(offsets.shape)}"
        )
    if native_grouped_mm_supported(a, b):
        return _grouped_mm_op(a, b, offsets.to(torch.int32))
    return _padded_bmm_grouped_mm(a, b.to(a.dtype), offsets)


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the flattened (token, slot) pairs by expert.

    Returns `order` (positions into top_k_index.reshape(-1), stable, so within one expert tokens
    keep their order) and `offsets` (int32 cumulative group ends, one per expert).
    """
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # scatter_add_ rather than bincount: no host sync, and out-of-range ids raise instead of growing bins
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order, torch.cumsum(counts, 0).to(torch.int32)


class GroupedExperts(nn.Module):
    """Drop-in for a Hugging Face experts module; parameters keep their names and objects.

    gate_up_proj [E, 2I, H] holds gate rows then up rows; down_proj [E, H, I]. Forward:
    (hidden_states [T,H], top_k_index [T,k], top_k_weights [T,k]) -> [T,H], computing
    sum over slots of w * down(act(gate(x)) * up(x)) exactly as transformers' eager loop does: the
    product with the routing weights is taken in their dtype (float32 routers promote) and cast
    back to the hidden dtype before the tokens are summed.
    """

    def __init__(
        self, num_experts: int, hidden_dim: int, intermediate_dim: int, act_fn: nn.Module, *, device=None, dtype=None
    ):
        super().__init__()
        self.num_experts = num_experts
        self.hidden_dim = hidden_dim
        self.intermediate_dim = intermediate_dim
        factory = {"device": device, "dtype": dtype}
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_dim, hidden_dim, **factory))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_dim, intermediate_dim, **factory))
        self.act_fn = act_fn

    @classmethod
    def from_hf(cls, experts: nn.Module) -> GroupedExperts:
        """Take over an HF experts module's Parameter objects (no copy, any device, meta included)."""
        unsupported = [
            flag
            for flag, default in (
                ("has_bias", False),
                ("is_transposed", False),
                ("has_gate", True),
                ("has_post_expert_norm", False),
            )
            if getattr(experts, flag, default) != default
        ]
        if unsupported or getattr(experts, "is_concatenated", True) is not True:
            raise NotImplementedError(
                f"{type(experts).__name__} uses an experts layout GroupedExperts lacks: {unsupported}"
            )
        with torch.device("meta"):
            grouped = cls(experts.num_experts, experts.hidden_dim, experts.intermediate_dim, experts.act_fn)
        grouped.gate_up_proj = experts.gate_up_proj
        grouped.down_proj = experts.down_proj
        return grouped

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        # Same calls in the same order as the HF families' _init_weights, so one seed gives the same
        # weights with and without the swap.
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=std)
        nn.init.normal_(self.down_proj, mean=0.0, std=std)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_tokens, top_k = top_k_index.shape
        order, offsets = sort_by_expert(top_k_index, self.num_experts)
        token_of_row = order // top_k
        gate_up, down = self.gate_up_proj, self.down_proj
        dtype = compute_dtype(hidden_states)
        if dtype != gate_up.dtype:  # under autocast the experts' products run in its dtype, as nn.Linear's do
            gate_up, down = gate_up.to(dtype), down.to(dtype)
        align = _group_alignment(hidden_states.device, dtype)
        if align > 1:
            # Groups padded with zero rows to multiples of `align`: matmul libraries that build a
            # kernel per shape (oneDNN for bf16 on the CPU) then see a few shapes, not new ones
            # every step. Pad rows stay zero through SwiGLU and are never read back.
            token_of_slot, row_slot, offsets = _padded_slots(token_of_row, top_k_index.reshape(-1)[order], offsets,
                                                             num_tokens, align)
            padded_input = torch.cat([hidden_states, hidden_states.new_zeros(1, hidden_states.shape[-1])])
            rows = padded_input.index_select(0, token_of_slot).to(dtype)
        else:
            # index_select, not hidden_states[token_of_row]: its backward is an index_add, several
            # times faster on the CPU than the accumulating index_put that indexing's backward runs
            rows = hidden_states.index_select(0, token_of_row).to(dtype)
        gate, up = grouped_mm(rows, gate_up.transpose(-2, -1), offsets).chunk(2, dim=-1)
        rows = grouped_mm(self.act_fn(gate) * up, down.transpose(-2, -1), offsets)
        if align > 1:
            rows = rows.index_select(0, row_slot)
        rows = (rows * top_k_weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(hidden_states.dtype)
        return hidden_states.new_zeros(num_tokens, hidden_states.shape[-1]).index_add(0, token_of_row, rows)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden_dim={self.hidden_dim}, intermediate_dim={self.intermediate_dim}"


def swap_experts(model: nn.Module) -> int:
    """Replace every HF experts module of a supported family with GroupedExperts; return how many.

    Raises RuntimeError if any parameter changed object or name (it would be a bug here, and it
    would silently detach optimizers, tied weights and sharding from the model).
    """
    before = dict(model.named_parameters(remove_duplicate=False))
    targets = [(name, module) for name, module in model.named_modules() if isinstance(module, all_experts_classes())]
    for name, module in targets:
        parent_name, _, child_name = name.rpartition(".")
        setattr(model.get_submodule(parent_name), child_name, GroupedExperts.from_hf(module))
    after = dict(model.named_parameters(remove_duplicate=False))
    lost = [name for name, param in before.items() if after.get(name) is not param]
    if lost or after.keys() != before.keys():
        raise RuntimeError(f"swap_experts changed parameters: {lost or sorted(after.keys() ^ before.keys())}")
    return len(targets)
