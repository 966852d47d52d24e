"""The bytes a rank sends per optimizer step, by collective and mesh dimension: every collective
of the step with its group, bytes and calls (`step_collectives`, as `COMM_FORMULA` states it),
which plan_time.py also times, and MegaMoE's exposed communication, simulated from its wave
graphs ([Note: how the plan is made], planner.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel import mx
from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.fsdp.gather import PURPOSES
from hyperparallel.models.flops import top_k_of
from hyperparallel.models.layers import decoder_layers, layer_configs
from hyperparallel.moe.dispatch import dispatch_format
from hyperparallel.moe.exchange import ELEMENTS
from hyperparallel.parallel.expert_parallel import moe_shape, routed_experts
from hyperparallel.parallel.mesh import MeshShape
from hyperparallel.parallel.tensor_parallel import tensor_parallel_state
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.device_model import DeviceModel
from hyperparallel.train.planning.memory import Group, nbytes
from hyperparallel.train.planning.pipeline import StageCalls
from hyperparallel.train.planning.plan_time import Collective, spans_nodes

COMM_FORMULA = (
    "ring algorithms, bytes this rank sends (hyperparallel.traffic's conventions): all-gather (W-1) x its slot, "
    "reduce-scatter (W-1)/W x its input ((W-1) x slot), all-reduce 2 (W-1)/W x bytes, all-to-all (W-1)/W x bytes "
    "(uniform routing: the counter counts the real rows to other ranks); FSDP gathers each layer twice per "
    "micro-batch (forward, backward) and the root once (a pipeline stage's in each forward, and in backward where "
    "the schedule frees it), as bytes: every parameter a piece in its gathered dtype (bf16 "
    "for the products' parameters under bf16 mixed precision, their own for the others) or, for MXFP8 weights, FP8 "
    "data and E8M0 scales (forward's copy, then backward's; the root both at once), each piece padded to 16 bytes; "
    "it reduce-scatters every group once per step in parallel.reduce_dtype (HSDP then all-reduces each group's "
    "gradient shards across the replicas); DDP all-reduces the gradients once per step (bf16 with reduce_dtype "
    "bfloat16); TP all-reduces (SP: all-gathers and reduce-scatters) every attention and MLP block's activations "
    "forward, backward and in recompute's replay, the vocab-parallel embedding's output and the head's input "
    "gradient; CP passes keys and values around the ring once forward and twice "
    "backward (Ulysses: all-to-alls); EP exchanges the per-expert counts, then sends every routed row out and back, "
    "forward and backward (out forward as MX data, H + H/32 bytes a row, to MXFP8 experts under moe.dispatch auto "
    "or mx; else in the compute dtype); Muon on sharded matrices sends each matrix's rows to its owner and the owner "
    "sends the update's rows back (bf16); a pipeline stage sends each micro-batch's activations (with its ids, "
    "labels and positions) to the next and their gradient back"
)


def _activation_bytes(cfg: TrainConfig) -> int:
    """Bytes of one activation element: bf16 under mixed precision, else the model's dtype."""
    dtype = torch.bfloat16 if cfg.training.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]
    return dtype.itemsize


def _tp_partial_bytes(model: nn.Module) -> int:
    """Bytes of the gradients TP sums over its group after backward (`sync_partial_grads`): the
    ones the split of the model's plan marked partial (`split_tensor_parallel`)."""
    state = tensor_parallel_state(model)
    if state is None:
        return 0
    return sum(nbytes(q) for name, q in model.named_parameters() if name in state.partial)


def _attention_widths(config) -> tuple[int, int]:
    """(query width, key + value width) per token of one attention layer, whole (all heads): the
    widest layer's where the config lets them vary by layer."""
    widths = [_layer_attention_widths(layer) for layer in layer_configs(config)]
    return max(q for q, _ in widths), max(kv for _, kv in widths)


def _layer_attention_widths(config) -> tuple[int, int]:
    heads = config.num_attention_heads
    if hasattr(config, "qk_nope_head_dim"):  # multi-head latent attention: keys and values per head
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        return heads * qk, heads * (qk + config.v_head_dim)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return heads * head_dim, 2 * kv_heads * head_dim


def step_collectives(cfg: TrainConfig, layout: MeshShape, model: nn.Module, whole_config, groups: list[Group],
                     grads_whole: int, accumulation: int, muon_sent: int, experts: set[int],
                     ranks_per_node: int, stage: StageCalls | None = None) -> list[Collective]:
    """Every collective of one optimizer step of this rank (plan_time.Collective: group, bytes, calls).
    `stage`: a pipeline rank's count of what runs once a micro-batch without one (planning/pipeline.py)."""
    out: list[Collective] = []
    p = cfg.parallel
    R, S, C, T, E = layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep
    # the mesh's strides (dp_replicate, dp_shard, cp, tp; tp innermost), for which groups leave a machine
    fsdp_spans = spans_nodes(T, S * C, ranks_per_node)
    expert_shard_spans = spans_nodes(E * T, S * C // max(E, 1), ranks_per_node)
    # a recomputed layer's forward collectives run again (selective recompute keeps only products'
    # and attention's outputs: the collectives, ring attention and the dispatch are replayed)
    replays = 1 if p.recompute != "off" else 0
    if layout.fsdp_enabled:
        n_layers = len(groups) - 1
        reduces = accumulation if p.sync_every_micro_batch else 1
        for g, group in enumerate(groups):
            # [Note: what a gather carries], fsdp/group.py: a layer gathers its values with its
            # codecs' forward pieces in forward and again with their backward pieces in backward;
            # the root, never freed after forward, gathers all of them once (per micro-batch; a
            # pipeline stage's `root_gathers` times: planning/pipeline.py)
            gathers = [("forward",), ("backward",)] if g < n_layers else [PURPOSES]
            for world, part in group.parts.items():
                experts_part = world != layout.shard_size  # (a layer's experts: a group of their own)
                spans = expert_shard_spans if experts_part else fsdp_spans
                sizes = [part.gather(purposes) for purposes in gathers]
                if g < n_layers and replays:
                    # recompute's forward inside backward: the layer's codecs' forward pieces again
                    # (the Note's "forward" once more); its experts' group, which the replay calls
                    # as a module, gathered for a forward again, values and forward pieces
                    sizes.append(part.gather(("forward",)) if experts_part else part.codec["forward"])
                calls = accumulation if g < n_layers or stage is None else stage.root_gathers
                for size in sizes:
                    if size:
                        out.append(Collective("fsdp_all_gather", "dp_shard", "all_gather", world, size, calls,
                                              spans, "beside"))
                if part.reduce:
                    out.append(Collective("fsdp_reduce_scatter", "dp_shard", "reduce_scatter", world, part.reduce,
                                          reduces, spans, "beside"))
                    out.append(Collective("hsdp_all_reduce", "dp_replicate", "all_reduce", R, part.reduce, reduces,
                                          spans_nodes(S * C * T, R, ranks_per_node), "beside"))
        if muon_sent:
            out.append(Collective("muon_all_to_all", "dp_shard", "all_to_all", layout.shard_size,
                                  muon_sent * layout.shard_size // max(layout.shard_size - 1, 1), 1, fsdp_spans))
    elif layout.ddp:
        # in the gradients' dtype, or bf16 with parallel.reduce_dtype bfloat16 (DDP's bf16 compress hook)
        reduced = grads_whole
        if p.reduce_dtype == "bfloat16":
            reduced = sum(q.numel() for q in model.parameters() if q.requires_grad) * torch.bfloat16.itemsize
        out.append(Collective("ddp_all_reduce", "dp_replicate", "all_reduce", layout.world, reduced, 1,
                              spans_nodes(1, layout.world, ranks_per_node), "beside"))
    config = model.config
    element = _activation_bytes(cfg)
    tokens = cfg.training.micro_batch * cfg.data.seq_len // C  # one micro-batch's tokens on this rank
    layers = list(decoder_layers(model))
    n_layers = len(layers)
    if T > 1:
        act = tokens * config.hidden_size * element
        tp_spans = spans_nodes(1, T, ranks_per_node)
        # TP's blocks, as the model's split placed them: each enters and leaves the TP region
        # (its routed experts are not split by TP: tensor_parallel.py)
        state = tensor_parallel_state(model)
        held = {name for name, _ in model.named_modules()}  # (a pipeline rank: its stages' blocks)
        per_pass = sum(1 for block in state.blocks if block in held) if state is not None else 0
        blocks = accumulation * per_pass * (2 + replays)  # forward, backward, replay
        if p.sequence_parallel:
            out.append(Collective("tp_all_gather", "tp", "all_gather", T, act // T, blocks, tp_spans))
            out.append(Collective("tp_reduce_scatter", "tp", "reduce_scatter", T, act // T, blocks, tp_spans))
        else:
            out.append(Collective("tp_all_reduce", "tp", "all_reduce", T, act, blocks, tp_spans))
        embeddings, losses = (accumulation, accumulation) if stage is None else (stage.embeddings, stage.losses)
        out.append(Collective("tp_embedding_all_reduce", "tp", "all_reduce", T, act, embeddings, tp_spans))
        out.append(Collective("tp_loss_all_reduce", "tp", "all_reduce", T, tokens * 4, 3 * losses, tp_spans))
        # the vocab-parallel head's input gradient, summed over the ranks' vocabulary parts in backward
        out.append(Collective("tp_head_all_reduce", "tp", "all_reduce", T, act, losses, tp_spans))
        out.append(Collective("tp_partial_grads", "tp", "all_reduce", T, _tp_partial_bytes(model), 1, tp_spans))
    if C > 1:
        q_width, kv_width = _attention_widths(whole_config)
        cp_spans = spans_nodes(T, C, ranks_per_node)
        if p.cp_mode == "ring":  # keys and values around the ring: once forward, twice backward (with their grads)
            passes = accumulation * n_layers * (3 + replays)
            out.append(Collective("cp_ring", "cp", "all_gather", C, tokens * kv_width * element, passes, cp_spans))
            # (the gradients' last pass, to the block's owner: C passes to the keys' and values' C - 1)
            out.append(Collective("cp_ring_grad_home", "cp", "all_gather", 2, tokens * kv_width * element,
                                  accumulation * n_layers, cp_spans))
        else:  # Ulysses: queries, keys, values and the output, all-to-all forward and backward
            calls = accumulation * n_layers * (2 + replays)
            out.append(Collective("cp_all_to_all", "cp", "all_to_all", C, tokens * (2 * q_width + kv_width) * element,
                                  calls, cp_spans))
    if E > 1:
        exposure = "simulated" if cfg.moe.implementation == "megamoe" else "critical"
        ep_spans = spans_nodes(T, E, ranks_per_node)
        passes = accumulation * (1 + replays)  # each MoE layer's forward, and recompute's replay of it
        for experts, _ in routed_experts(model):
            # moe/dispatch.py, moe/exchange.py: every (token, expert) row of this rank's tokens out
            # to its expert's rank and back, forward and backward, after one exchange of the
            # per-expert row counts (int64); the rows go out in the compute dtype or, to MXFP8
            # experts under moe.dispatch auto / mx, as MX data (FP8 elements then E8M0 scales per
            # row: [Note: MX dispatch]), and come back, and go both ways in backward, in the compute dtype
            rows = tokens * top_k_of(model, experts)
            hidden = experts.hidden_dim
            row_bytes = hidden * element
            if dispatch_format(cfg.moe.dispatch, experts) == "mx":
                sent_row = hidden * ELEMENTS.itemsize + -(-hidden // mx.BLOCK_SIZE) * torch.float8_e8m0fnu.itemsize
            else:
                sent_row = row_bytes
            # (named as the counter names them: moe/exchange.py)
            for name, nbytes_, calls in (("ep_counts", experts.routed_experts * torch.int64.itemsize, passes),
                                         ("ep_dispatch", rows * sent_row, passes),
                                         ("ep_combine", rows * row_bytes, passes),
                                         ("ep_dispatch_grad", rows * row_bytes, accumulation),
                                         ("ep_combine_grad", rows * row_bytes, accumulation)):
                out.append(Collective(name, "ep", "all_to_all", E, nbytes_, calls, ep_spans, exposure))
    return [c for c in out if c.ranks > 1 and c.calls]


def megamoe_exposed_s(cfg: TrainConfig, layout: MeshShape, model: nn.Module, device: DeviceModel) -> float:
    """MegaMoE's exposed communication per micro-batch: every MoE layer's wave graphs (forward and
    backward) simulated with this device's costs (multicore.simulate)."""
    from hyperparallel.moe import default_waves
    from hyperparallel.moe.megamoe_graphs import plan_graphs
    from hyperparallel.multicore import EXECUTORS, CostModel
    from hyperparallel.multicore import simulate as simulate_graph

    layers = routed_experts(model)
    if not layers or not layout.ep_enabled:
        return 0.0
    shape = moe_shape(model, cfg.training.micro_batch * cfg.data.seq_len // layout.cp, _activation_bytes(cfg))
    element = shape.element_bytes
    bandwidth, latency = device.link(spans_nodes(layout.tp, layout.ep, device.ranks_per_node))
    cost = CostModel(matmul_flops=device.flops_for("bfloat16" if element == 2 else "float32"),
                     memory_bytes_per_s=device.memory_bytes_per_s, link_bytes_per_s=bandwidth,
                     link_latency_s=latency, task_overhead_s=device.op_floor_s)
    executor = EXECUTORS["cuda"]  # (called for devices that overlap: GPUs' streams)
    waves = cfg.moe.waves or default_waves(shape, layout.ep, cost, **executor)
    forward, backward = plan_graphs(shape, layout.ep, waves)
    exposed = sum(simulate_graph(graph, cost, **executor).exposed_comm_s for graph in (forward, backward))
    return exposed * len(layers)
