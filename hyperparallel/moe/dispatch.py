"""Expert parallelism: each rank of an EP group holds some of the experts, and every (token, slot)
pair of a top-k routing travels to the rank of its expert and back.

The experts are split into contiguous ranges (`expert_ranges`: rank r holds experts
offset_r .. offset_r + count_r - 1, the counts differing by at most one). How a token travels,
in `ExpertParallel.__call__`:

1. sort: the (token, slot) pairs of this rank are ordered by global expert (`sort_by_expert`).
   Because every rank's experts are one contiguous range, the rows bound for one destination
   are then contiguous too, in the order [destination][expert][token].
2. counts: one all_to_all_single of the per-expert counts tells each rank, per source rank,
   how many rows each of its local experts will receive. These counts are read on the host
   once (one `.tolist()`), since all_to_all_single takes its split sizes as Python ints; the
   same split sizes serve the combine and both backward exchanges, so backward has no host sync.
3. dispatch: the rows (hidden vectors of the sorted pairs) go out with all_to_all_single, in
   the products' compute dtype or, with MXFP8 experts, as MX data (`dispatch="mx"`:
   moe.exchange's [Note: MX dispatch]); a rank receives them in [source][expert] order.
4. regroup: a permutation computed on the device from the counts reorders them to
   [expert][source], the layout the grouped products need; within one expert the rows come
   from source 0, 1, ... in each source's token order, so they sit in the order one process
   running all experts on the concatenation of the ranks' tokens would have them.
5. `experts(rows, offsets=ends)` runs the local experts' two grouped products (no routing
   weights), called as the module so that its hooks (FSDP's gathers) run.
6. the inverse regroup, then the combine (the reverse all_to_all_single, in the compute dtype)
   brings every row back to the rank and position it came from.
7. as `GroupedExperts.forward` does: rows times their routing weights (in the weights' dtype,
   cast to the hidden dtype), summed into their tokens (`add_rows_to_tokens`).

Dropless: no capacity, any counts (zero tokens on a rank, an expert or a rank that receives
nothing, everything routed to one expert). The exchanges are differentiable: backward of an
all_to_all_single is the all_to_all_single with the split sizes swapped.

Every rank of the group must call the dispatcher the same number of times, in the same order,
and (for backward) with the same requires_grad on its tokens: each call is a collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hyperparallel import traffic
from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.lowp.grouped import MXExpertsRecipe
from hyperparallel.moe.exchange import AllToAll, MXRows, mx_dispatch
from hyperparallel.moe.experts import GroupedExperts
from hyperparallel.moe.permutation import add_rows_to_tokens, sort_by_expert

# the formats a dispatcher sends rows to the experts in (moe.dispatch's values but auto)
DISPATCH_FORMATS = ("compute", "mx")


def expert_ranges(num_experts: int, ep_size: int) -> list[tuple[int, int]]:
    """(offset, count) of the experts each of `ep_size` ranks holds: contiguous ranges whose counts
    differ by at most one, the larger first (10 experts on 4 ranks: 3, 3, 2, 2)."""
    if ep_size < 1:
        raise ConfigError(f"expert parallelism needs at least one rank, got an EP size of {ep_size}")
    if num_experts < ep_size:
        raise ConfigError(f"expert parallelism over {ep_size} ranks needs at least {ep_size} experts (one per "
                          f"rank), but the model has {num_experts}: use an EP size of at most {num_experts}")
    return split_evenly(num_experts, ep_size)


def split_evenly(total: int, parts: int) -> list[tuple[int, int]]:
    """(offset, count) of `parts` contiguous ranges covering 0..total-1, counts differing by at
    most one, the larger first (some empty when parts > total)."""
    base, extra = divmod(total, parts)
    ranges, offset = [], 0
    for part in range(parts):
        count = base + (part < extra)
        ranges.append((offset, count))
        offset += count
    return ranges


def dispatch_format(dispatch: str, experts: GroupedExperts) -> str:
    """The format ("compute" or "mx") rows go to `experts` in for `moe.dispatch` (auto, compute or
    mx): auto sends MX rows to MXFP8 experts whose weight gradient is MXFP8 too (with a
    high-precision one, what it asks for is the rows' own values), compute rows to others; mx to
    experts that are not MXFP8 is a ConfigError."""
    mx_experts = isinstance(experts.recipe, MXExpertsRecipe)
    if dispatch == "auto":
        return "mx" if mx_experts and experts.recipe.config.wgrad == "mxfp8" else "compute"
    if dispatch == "mx" and not mx_experts:
        raise ConfigError(f"moe.dispatch: mx sends the experts their rows as MXFP8 data, and these experts run "
                          f"{experts.recipe.describe()}; train them in MXFP8 (low_precision.enabled with experts in "
                          f"low_precision.modules) or use moe.dispatch: auto")
    if dispatch not in DISPATCH_FORMATS:
        raise ConfigError(f"moe.dispatch must be auto or one of {', '.join(DISPATCH_FORMATS)}, got {dispatch!r}")
    return dispatch


def _regroup_index(per_source: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Positions into rows laid out [source][expert] (counts `per_source` [S, L]) that read them in
    [expert][source] order; `num_rows` (their total, known on the host) keeps this free of syncs."""
    sources, local = per_source.shape
    start_in_received = (torch.cumsum(per_source.reshape(-1), 0) - per_source.reshape(-1)).view(sources, local)
    counts = per_source.t().reshape(-1)  # blocks in [expert][source] order
    start_in_received = start_in_received.t().reshape(-1)
    start_in_grouped = torch.cumsum(counts, 0) - counts
    block = torch.repeat_interleave(torch.arange(counts.shape[0], device=counts.device), counts,
                                    output_size=num_rows)
    return torch.arange(num_rows, device=counts.device) - start_in_grouped[block] + start_in_received[block]


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.shape[0], device=permutation.device)
    return inverse


class ExpertParallel:
    """The dispatcher a `MoEBlock` calls under expert parallelism (`block.dispatcher`), or a
    `GroupedExperts` inside transformers' own MoE block (`experts.dispatcher`).

    `process_group`: the EP group (the world's or a subgroup; ranks are its group ranks), whose
    rank r holds experts `ranges[r]` of `num_experts`. Calling it computes what
    `GroupedExperts.forward` on all experts would compute for this rank's tokens. `dispatch`:
    the rows' format on the way to the experts, "compute" or "mx" (MXFP8 experts only: the
    forward is the same to the bit, the first projection's weight gradient quantizes the rows'
    MX values; moe.exchange's [Note: MX dispatch]); `dispatch_format` picks it from moe.dispatch.
    """

    def __init__(self, process_group, num_experts: int, *, dispatch: str = "compute"):
        if dispatch not in DISPATCH_FORMATS:
            raise ConfigError(f"an expert-parallel dispatch sends rows as one of {', '.join(DISPATCH_FORMATS)}, "
                              f"got {dispatch!r}")
        self.dispatch = dispatch
        self.process_group = process_group
        self.num_experts = num_experts
        self.ep_size = dist.get_world_size(process_group)
        self.ep_rank = dist.get_rank(process_group)
        if self.ep_rank < 0:
            raise ConfigError(f"rank {dist.get_rank()} is not in the expert-parallel process group it was given; "
                              f"build ExpertParallel with the EP group this rank belongs to")
        self.ranges = expert_ranges(num_experts, self.ep_size)
        self.local_range = self.ranges[self.ep_rank]  # (offset, count) of this rank's experts

    @torch.compiler.disable  # the split sizes are host ints: a compiled graph would break here anyway
    def __call__(self, experts: GroupedExperts, tokens: torch.Tensor, indices: torch.Tensor,
                 weights: torch.Tensor, *, inside: bool = False) -> torch.Tensor:
        """tokens [T, H], indices [T, k] (global expert ids), weights [T, k] -> [T, H]. `inside`:
        called from the experts module's own forward (a MoE block that is transformers' own), whose
        hooks have run: the products are then run directly."""
        self._check(experts, tokens, indices, weights)
        num_tokens, top_k = indices.shape
        order, ends = sort_by_expert(indices, self.num_experts)
        token_of_row = order // top_k
        per_source, send_splits, recv_splits = self._exchange_counts(ends)
        regroup = _regroup_index(per_source, sum(recv_splits))
        local_ends = torch.cumsum(per_source.sum(0), 0).to(torch.int32)
        if self.dispatch == "mx":
            rows = MXRows.of(tokens, token_of_row, experts.recipe)
            grouped, quantized = mx_dispatch(tokens, rows, regroup, send_splits, recv_splits, self.process_group)
        else:
            # rows travel in the products' dtype (autocast's, when on): what GroupedExperts.forward
            # casts them to before its products, and half the bytes of fp32 under bf16 autocast
            rows = tokens.index_select(0, token_of_row).to(experts.recipe.compute_dtype(tokens))
            received = AllToAll.apply(rows, send_splits, recv_splits, self.process_group, "dispatch")
            grouped, quantized = received.index_select(0, regroup), None
        # called as the module (not run_sorted): its hooks, FSDP's gathers among them, must run
        run = experts.run_sorted if inside else experts
        done = run(grouped, offsets=local_ends, quantized=quantized)
        done = done.index_select(0, _inverse(regroup))
        returned = AllToAll.apply(done, recv_splits, send_splits, self.process_group, "combine")
        returned = (returned * weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(tokens.dtype)
        return add_rows_to_tokens(returned, token_of_row, num_tokens)

    def _exchange_counts(self, ends: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
        """From this rank's cumulative per-expert ends [E]: per source rank, the rows each local
        expert receives ([S, L], on the device), and the rows sent to / received from each rank."""
        counts = torch.diff(ends.long(), prepend=ends.new_zeros(1, dtype=torch.long))
        per_source = self.exchange_counts(counts).view(self.ep_size, self.local_range[1])
        # the one host read of this forward, since split sizes are Python ints: this rank's
        # cumulative ends (whose values at the ranges' ends give the rows sent to each rank) and
        # the rows coming from each rank
        host = torch.cat([ends.long(), per_source.sum(1)]).tolist()
        host_ends, recv_splits = host[:self.num_experts], host[self.num_experts:]
        send_splits = [host_ends[offset + count - 1] - (host_ends[offset - 1] if offset else 0)
                       for offset, count in self.ranges]
        return per_source, send_splits, recv_splits

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """Per-expert row counts [E] out to the experts' ranks; what each source sends this rank's
        experts back, [source][local expert] flat."""
        local, send_splits = self.local_range[1], [count for _, count in self.ranges]
        received = counts.new_empty(self.ep_size * local)
        traffic.all_to_all("ep", counts, send_splits, self.process_group, name="counts")
        dist.all_to_all_single(received, counts, [local] * self.ep_size, send_splits, group=self.process_group)
        return received

    def _check(self, experts: GroupedExperts, tokens: torch.Tensor, indices: torch.Tensor,
               weights: torch.Tensor) -> None:
        if self.dispatch == "mx":
            dispatch_format("mx", experts)  # (raised before any collective, so no rank waits for another)
        offset, count = self.local_range
        if experts.num_experts != count:
            raise ShapeError(f"expert-parallel rank {self.ep_rank} of {self.ep_size} holds experts {offset}.."
                             f"{offset + count - 1} ({count} of {self.num_experts}), but its GroupedExperts has "
                             f"{experts.num_experts}")
        if indices.dim() != 2 or tokens.dim() != 2 or tokens.shape[0] != indices.shape[0] \
                or weights.shape != indices.shape:
            raise ShapeError(f"expert parallelism needs tokens [T, H], indices [T, k] and weights [T, k]; got tokens "
                             f"{tuple(tokens.shape)}, indices {tuple(indices.shape)}, weights {tuple(weights.shape)}")
