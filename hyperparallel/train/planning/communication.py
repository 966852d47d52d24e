"""The bytes a rank sends per optimizer step, by collective and mesh dimension: every collective
of the step with its group, bytes and calls (`step_collectives`, as `COMM_FORMULA` states it),
which plan_time.py also times, and MegaMoE's exposed communication, simulated from its wave
graphs ([Note: how the plan is made], planner.py).
"""

from __future__ import annotations

import torch
from torch import nn

from hyperparallel.checkpoint.model_card import DTYPES
from hyperparallel.models.flops import top_k_of
from hyperparallel.models.layers import decoder_layers, layer_configs
from hyperparallel.parallel.expert_parallel import moe_shape, routed_experts
from hyperparallel.parallel.mesh import MeshShape
from hyperparallel.parallel.tensor_parallel import tensor_parallel_state
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.planning.device_model import DeviceModel
from hyperparallel.train.planning.memory import Group, nbytes
from hyperparallel.train.planning.plan_time import Collective, spans_nodes

COMM_FORMULA = (
    "ring algorithms, bytes this rank sends: all-gather and reduce-scatter of a group (W-1) x slot, all-reduce "
    "2 (W-1)/W x bytes, all-to-all (W-1)/W x bytes; FSDP gathers each layer twice per micro-batch (forward, backward) "
    "and the root once, and reduce-scatters every group once per step (HSDP then all-reduces each group's gradient "
    "shards across the replicas); DDP all-reduces the gradients once per step; TP all-reduces (SP: all-gathers and "
    "reduce-scatters) every attention and MLP block's activations forward, backward and in recompute's replay; CP "
    "passes keys and values around the ring once forward and twice backward (Ulysses: all-to-alls); EP sends every "
    "routed row out and back, forward and backward; Muon on sharded matrices sends each matrix's rows to its owner "
    "and the owner sends the update's rows back (bf16)"
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
                     ranks_per_node: int) -> list[Collective]:
    """Every collective of one optimizer step of this rank (plan_time.Collective: group, bytes, calls)."""
    out: list[Collective] = []
    p = cfg.parallel
    R, S, C, T, E = layout.dp_replicate, layout.dp_shard, layout.cp, layout.tp, layout.ep
    # the mesh's strides (dp_replicate, dp_shard, cp, tp; tp innermost), for which groups leave a machine
    fsdp_spans = spans_nodes(T, S * C, ranks_per_node)
    expert_shard_spans = spans_nodes(E * T, S * C // max(E, 1), ranks_per_node)
    if layout.fsdp_enabled:
        n_layers = len(groups) - 1
        for g, group in enumerate(groups):
            gathers = accumulation * (2 if g < n_layers else 1)  # a layer again in backward; the root once
            reduces = accumulation if p.sync_every_micro_batch else 1
            for world, slot in group.parts.items():
                spans = fsdp_spans if world == layout.shard_size else expert_shard_spans
                out.append(Collective("fsdp_all_gather", "dp_shard", "all_gather", world, slot, gathers, spans, "beside"))
                if group.trainable:
                    out.append(Collective("fsdp_reduce_scatter", "dp_shard", "reduce_scatter", world, slot, reduces,
                                          spans, "beside"))
                    out.append(Collective("hsdp_all_reduce", "dp_replicate", "all_reduce", R, slot, reduces,
                                          spans_nodes(S * C * T, R, ranks_per_node), "beside"))
        if muon_sent:
            out.append(Collective("muon_all_to_all", "dp_shard", "all_to_all", layout.shard_size,
                                  muon_sent * layout.shard_size // max(layout.shard_size - 1, 1), 1, fsdp_spans))
    elif layout.ddp:
        out.append(Collective("ddp_all_reduce", "dp_replicate", "all_reduce", layout.world, grads_whole, 1,
                              spans_nodes(1, layout.world, ranks_per_node), "beside"))
    config = model.config
    element = _activation_bytes(cfg)
    tokens = cfg.training.micro_batch * cfg.data.seq_len // C  # one micro-batch's tokens on this rank
    layers = list(decoder_layers(model))
    n_layers = len(layers)
    # a recomputed layer's forward collectives run again (selective recompute keeps only products'
    # and attention's outputs: the collectives, ring attention and the dispatch are replayed)
    replays = 1 if p.recompute != "off" else 0
    if T > 1:
        act = tokens * config.hidden_size * element
        tp_spans = spans_nodes(1, T, ranks_per_node)
        # TP's blocks, as the model's split placed them: each enters and leaves the TP region
        # (its routed experts are not split by TP: tensor_parallel.py)
        state = tensor_parallel_state(model)
        per_pass = len(state.blocks) if state is not None else 0
        blocks = accumulation * per_pass * (2 + replays)  # forward, backward, replay
        if p.sequence_parallel:
            out.append(Collective("tp_all_gather", "tp", "all_gather", T, act // T, blocks, tp_spans))
            out.append(Collective("tp_reduce_scatter", "tp", "reduce_scatter", T, act // T, blocks, tp_spans))
        else:
            out.append(Collective("tp_all_reduce", "tp", "all_reduce", T, act, blocks, tp_spans))
        out.append(Collective("tp_embedding_all_reduce", "tp", "all_reduce", T, act, accumulation, tp_spans))
        out.append(Collective("tp_loss_all_reduce", "tp", "all_reduce", T, tokens * 4, 3 * accumulation, tp_spans))
        out.append(Collective("tp_partial_grads", "tp", "all_reduce", T, _tp_partial_bytes(model), 1, tp_spans))
    if C > 1:
        q_width, kv_width = _attention_widths(whole_config)
        cp_spans = spans_nodes(T, C, ranks_per_node)
        if p.cp_mode == "ring":  # keys and values around the ring: once forward, twice backward (with their grads)
            passes = accumulation * n_layers * (3 + replays)
            out.append(Collective("cp_ring", "cp", "all_gather", C, tokens * kv_width * element, passes, cp_spans))
        else:  # Ulysses: queries, keys, values and the output, all-to-all forward and backward
            calls = accumulation * n_layers * (2 + replays)
            out.append(Collective("cp_all_to_all", "cp", "all_to_all", C, tokens * (2 * q_width + kv_width) * element,
                                  calls, cp_spans))
    if E > 1:
        layers_ = routed_experts(model)
        top_k = top_k_of(model, layers_[0][0]) if layers_ else 1
        rows = tokens * top_k * config.hidden_size * element
        exposure = "simulated" if cfg.moe.implementation == "megamoe" else "critical"
        calls = accumulation * len(layers_) * 2 * (2 + replays)  # dispatch and combine: forward, backward, replay
        out.append(Collective("ep_all_to_all", "ep", "all_to_all", E, rows, calls, spans_nodes(T, E, ranks_per_node),
                              exposure))
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
