"""MegaMoE: the expert-parallel MoE layer as task graphs whose all-to-alls overlap the experts' work.

`ExpertParallel` (hyperparallel.moe.dispatch) sends every row out, runs all local experts and sends
every row back, each exchange waiting for the whole of the step before. MegaMoE splits each rank's
local experts into K contiguous *waves* (`wave_ranges`) and runs the layer as one
`multicore.TaskGraph` (built in hyperparallel.moe.megamoe_graphs) with, per wave,

    dispatch[w] (comm) -> regroup[w] (vector) -> experts[w] (matmul) -> unregroup[w] (vector) -> combine[w] (comm)

Communication is issued in the order dispatch 0, dispatch 1, combine 0, dispatch 2, combine 1, ...:
while wave w's products run, wave w+1's rows arrive and wave w-1's results leave. The shared
experts (DeepSeek), which need no exchange, are one compute task right after the first dispatch,
where the compute lane would otherwise wait for it.

Backward is a graph of the same shape: the combine's reverse exchange of wave w, its input-gradient
products (`dgrad[w]`) and the dispatch's reverse exchange; each wave's weight-gradient products
(`wgrad[w]`) come one wave behind, after the next wave's dgrad, filling the exchanges' time, and
the shared experts' backward right after the first exchange. The products are the recipe's three
stages (`hyperparallel.moe.stages`: high precision or MXFP8), which compute what its autograd path
computes.

With `dispatch="mx"` (MXFP8 experts) the dispatch waves carry the rows as MX data and each
wave's experts take them as their first product's operand: the forward is bit for bit the
compute-dtype dispatch's, the combines and every backward exchange stay in the compute dtype
(moe.exchange's [Note: MX dispatch]).

Rows travel wave-major ([wave][destination][expert][token]), so each wave's rows for every
destination are one contiguous range and one all_to_all_single sends a wave. Within an expert the
rows keep the order `ExpertParallel` gives them, so the products see the same rows: outputs and
gradients equal the sequential layer's to fp32 rounding (the sum over a token's k results runs in
another order). The count exchange and its one host read are `ExpertParallel`'s. Every rank must
use the same K, since K fixes the collectives.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from hyperparallel.errors import ConfigError
from hyperparallel.moe.dispatch import ExpertParallel
from hyperparallel.moe.exchange import MXRows
from hyperparallel.moe.experts import GroupedExperts
from hyperparallel.moe.megamoe_graphs import Layout, WavePipeline, wave_ranges
from hyperparallel.moe.permutation import add_rows_to_tokens
from hyperparallel.multicore import run as run_graph


class MegaMoE(ExpertParallel):
    """The dispatcher a `MoEBlock` calls under expert parallelism with `moe.implementation: megamoe`:
    what `ExpertParallel` computes, as overlapped task graphs of `waves` expert waves. `last_stats`
    holds the latest forward's and backward's `multicore.RunStats`; overlap=False runs the same
    graphs with every exchange waited for at once (for measuring each task alone); `dispatch` as
    ExpertParallel's."""

    runs_shared_experts = True

    def __init__(self, process_group, num_experts: int, waves: int, *, overlap: bool = True, dispatch: str = "compute"):
        super().__init__(process_group, num_experts, dispatch=dispatch)
        self.overlap = overlap
        most = max(count for _, count in self.ranges)
        if not 1 <= waves <= most:
            raise ConfigError(f"moe.waves must be between 1 and the most experts one EP rank holds ({most}: "
                              f"{num_experts} experts over {self.ep_size} ranks), got {waves}")
        self.waves = waves
        self.wave_of = [wave_ranges(count, waves) for _, count in self.ranges]  # per EP rank
        place, position = [0] * num_experts, 0  # each expert's place in the order [wave][rank][local expert]
        for w in range(waves):
            for (offset, _), rank_waves in zip(self.ranges, self.wave_of, strict=True):
                lo, count = rank_waves[w]
                for expert in range(offset + lo, offset + lo + count):
                    place[expert] = position
                    position += 1
        self.wave_major = torch.tensor(place)
        self.last_stats: dict[str, object] = {}

    @torch.compiler.disable  # host-side sizes and a task graph: nothing a compiled graph can hold
    def __call__(self, experts: GroupedExperts, tokens: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                 shared_experts: nn.Module | None = None, *, inside: bool = False):
        """As ExpertParallel's; with `shared_experts`, returns (routed output, shared experts' output)."""
        self._check(experts, tokens, indices, weights)
        num_tokens, top_k = indices.shape
        dtype = experts.recipe.compute_dtype(tokens)
        order = torch.argsort(self.wave_major.to(indices.device)[indices.reshape(-1)], stable=True)
        token_of_row = order // top_k
        if self.dispatch == "mx":  # the tokens themselves: the graph sends their rows quantized
            wire, source = MXRows.of(tokens, token_of_row, experts.recipe), tokens
        else:
            wire, source = None, tokens.index_select(0, token_of_row).to(dtype)
        pipeline = WavePipeline(self.layout(indices), self.waves, self.process_group, experts, shared_experts,
                                grad_enabled=torch.is_grad_enabled(), wire=wire)
        shared_input = tokens if shared_experts is not None else None
        shared_params = [p for p in shared_experts.parameters() if p.requires_grad] if shared_experts is not None else []
        # called as the module: its hooks (FSDP's gathers) run around the graph, as for ExpertParallel
        graphs = lambda module: _MegaMoEFunction.apply(  # noqa: E731
            self, pipeline, source, module.gate_up_proj, module.down_proj, shared_input, *shared_params)
        outputs = graphs(experts) if inside else experts(source, pipeline=graphs)
        returned = (outputs[0] * weights.reshape(-1).index_select(0, order).unsqueeze(-1)).to(tokens.dtype)
        out = add_rows_to_tokens(returned, token_of_row, num_tokens)
        return (out, outputs[1].to(tokens.dtype)) if shared_experts is not None else out

    def layout(self, indices: torch.Tensor) -> Layout:
        """Exchange the per-expert counts (one all_to_all_single) and read them on the host (once)."""
        flat = indices.reshape(-1)
        counts = torch.zeros(self.num_experts, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        local = self.local_range[1]
        host = torch.cat([counts, self.exchange_counts(counts)]).tolist()
        sent, arrived = host[:self.num_experts], host[self.num_experts:]
        per_source = [arrived[s * local:(s + 1) * local] for s in range(self.ep_size)]
        send = [[sum(sent[offset + rank_waves[w][0]:offset + rank_waves[w][0] + rank_waves[w][1]])
                 for (offset, _), rank_waves in zip(self.ranges, self.wave_of, strict=True)] for w in range(self.waves)]
        mine = self.wave_of[self.ep_rank]
        recv = [[sum(source[lo:lo + count]) for source in per_source] for lo, count in mine]
        return Layout(mine, send, recv, per_source, self.ep_rank)


class _MegaMoEFunction(torch.autograd.Function):
    """Wave-major rows (or, with an MX dispatch, the tokens whose quantized rows the graph sends)
    -> the rows back from their experts (and the shared experts' output), by the pipeline's
    forward graph; backward by its backward graph."""

    @staticmethod
    def forward(ctx, moe: MegaMoE, pipeline: WavePipeline, source, gate_up_proj, down_proj, shared_input,
                *shared_params):
        rows = pipeline.wire.packed(source) if pipeline.wire is not None else source
        graph, outputs = pipeline.forward_graph(rows, shared_input)
        moe.last_stats["forward"] = run_graph(graph, overlap=moe.overlap)
        results = (outputs["returned"].tensor,) + ((outputs["shared"].tensor,) if shared_input is not None else ())
        graph.release()  # its buffers go now, not when the cycle collector finds them
        ctx.moe, ctx.pipeline, ctx.has_shared = moe, pipeline, shared_input is not None
        ctx.counts = [len(wave) for wave in pipeline.saved]
        # saved through autograd (not held by the pipeline), so that recompute can drop them
        ctx.save_for_backward(*[t for wave in pipeline.saved for t in wave])
        pipeline.saved = []
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx, d_returned, d_shared=None):
        flat, at = ctx.saved_tensors, 0  # unpacked once: checkpointing allows no more
        pipeline = ctx.pipeline
        for n in ctx.counts:
            pipeline.saved.append(list(flat[at:at + n]))
            at += n
        if d_shared is None and ctx.has_shared:
            d_shared = torch.zeros_like(pipeline.shared_graph["output"])
        graph, outputs = pipeline.backward_graph(d_returned.contiguous(), d_shared)
        ctx.moe.last_stats["backward"] = run_graph(graph, overlap=ctx.moe.overlap)
        d_rows = outputs["rows"].tensor
        d_source = pipeline.wire.tokens_grad(d_rows) if pipeline.wire is not None else d_rows
        grads = (None, None, d_source, outputs["gate_up_proj"].tensor, outputs["down_proj"].tensor)
        if ctx.has_shared:
            grads += (outputs["shared input"].tensor, *outputs["shared"])
        else:
            grads += (None,)
        # released now: the weight gradients then have no other owner, so autograd takes them as
        # they are instead of copying them into .grad
        graph.release()
        pipeline.saved, pipeline.shared_graph = [], {}
        return grads
