"""Tensor, sequence and context parallelism in the trainer's own build and step, on 4 gloo ranks,
against one process training the same model on the same global batch.

Every layout builds the model with `build_trained_model` (the trainer's mesh, TP plan, MXFP8,
EP, fused loss, CP and FSDP), runs STEPS `TrainStep`s (AdamW, clipping at 1.0) on the batches
`data.Batches` deals to its data-parallel replica, and records each step's loss (the mean over
ranks, as the trainer logs it) and the whole of every gradient the optimizer sees (assembled
from every rank's part by the chunk each records for checkpoints: so every part is also placed
where the checkpoint would put it). One process (the same config, one rank) is the reference.

AdamW's eps is 1e-5, not 1e-8: with 1e-8 an element whose gradient is rounding noise around 0
(measured: -3.9e-10 on 4 ranks, +2.4e-11 in one process) moves by +-lr in the first step, and the
later steps' gradients then differ by ~2e-5 of their norm for a reason that is Adam's, not the
layout's. With eps 1e-5 such an element barely moves.

The MoE case runs with the auxiliary loss off: it is a per-rank loss by design (each rank
balances its own tokens), as with data parallelism.

The session's shared 4-rank spawn (tests/dist/spawn.py) runs every layout (and tests/dist/test_context_parallel.py's cases), and the checkpoint cases: a tp=2 x dp_shard=2 checkpoint loads into
dp_shard=4, cp=2 x dp_shard=2 and one process with the same values, and its Hugging Face export
equals the one-process model's; a dp_replicate=2 x dp_shard=2 (HSDP) checkpoint loads at
dp_shard=4 and in one process, and holds each shard once.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from hyperparallel import checkpoint
from hyperparallel.checkpoint.export import export_hf
from hyperparallel.checkpoint.model_card import KEY as MODEL_CARD
from hyperparallel.checkpoint.sharded import shard_chunks
from hyperparallel.fsdp import shard_info
from hyperparallel.train import data
from hyperparallel.train.build import build_optimization, build_trained_model
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime, agree, joined
from hyperparallel.train.step import TrainStep

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
STEPS = 5
ROWS, SEQ = 8, 32  # the global batch: 8 sequences (2 per replica at dp_shard=4) of 32 tokens (divide by 2 x cp)
PAD = 0


def tiny(name: str, **overrides) -> dict:
    config = yaml.safe_load((CONFIGS / name).read_text())
    return config | overrides


MODELS = {
    "qwen3": ("qwen3", tiny("qwen3_tiny.yaml")),
    "kimi_k2": ("kimi_k2", tiny("kimi_k2_tiny.yaml")),
    "qwen3_moe": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml")),
    # MXFP8 quantizes in blocks of 32 along each product's dims: with 4 kv heads of 16 every
    # TP-local dim is a multiple of 32, so the blocks are the one-process model's
    "qwen3_kv4": ("qwen3", tiny("qwen3_tiny.yaml", num_key_value_heads=4)),
}
# name -> (model, parallel section, other sections); all at 4 ranks
LAYOUTS = {
    "qwen3_tp4": ("qwen3", {"tp": 4}, {}),  # 2 kv heads on 4 ranks: each kv head replicated on 2
    "qwen3_tp2_dp2": ("qwen3", {"tp": 2, "dp_shard": 2}, {}),
    "qwen3_tp2_sp_dp2": ("qwen3", {"tp": 2, "dp_shard": 2, "sequence_parallel": True, "recompute": "full"}, {}),
    "qwen3_tp4_sp": ("qwen3", {"tp": 4, "sequence_parallel": True}, {}),
    "kimi_k2_tp4": ("kimi_k2", {"tp": 4}, {}),
    "kimi_k2_tp2_sp_dp2": ("kimi_k2", {"tp": 2, "dp_shard": 2, "sequence_parallel": True}, {}),
    "qwen3_moe_tp2_ep2": ("qwen3_moe", {"tp": 2, "dp_shard": 2, "ep": 2, "sequence_parallel": True},
                          {"moe": {"aux_loss_coef": 0.0}}),
    "qwen3_mxfp8_tp2_dp2": ("qwen3_kv4", {"tp": 2, "dp_shard": 2}, {"low_precision": {"enabled": True}}),
    "qwen3_cp4_ring": ("qwen3", {"cp": 4, "cp_mode": "ring"}, {}),
    "qwen3_cp4_ulysses": ("qwen3", {"cp": 4, "cp_mode": "ulysses"}, {}),
    "qwen3_cp2_dp2_ring": ("qwen3", {"cp": 2, "dp_shard": 2, "cp_mode": "ring", "recompute": "selective"}, {}),
    "qwen3_cp2_dp2_ulysses": ("qwen3", {"cp": 2, "dp_shard": 2, "cp_mode": "ulysses"}, {}),
    "kimi_k2_cp2_dp2_ring": ("kimi_k2", {"cp": 2, "dp_shard": 2, "cp_mode": "ring"}, {}),
    # packed documents, positions restarting at each (document masks): through TP's and SP's
    # blocks and EP's dispatch the positions reach attention as in one process
    "qwen3_tp2_sp_dp2_documents": ("qwen3", {"tp": 2, "dp_shard": 2, "sequence_parallel": True},
                                   {"documents": True}),
    "qwen3_moe_tp2_ep2_documents": ("qwen3_moe", {"tp": 2, "dp_shard": 2, "ep": 2},
                                    {"moe": {"aux_loss_coef": 0.0}, "documents": True}),
    # HSDP: FSDP over 2 ranks, 2 replicas (shard groups [0, 1] [2, 3], replica groups [0, 2] [1, 3])
    "qwen3_hsdp2x2": ("qwen3", {"dp_replicate": 2, "dp_shard": 2}, {}),
    # each replica's experts split over its 2 ranks (ep groups [0, 1] [2, 3]), every expert's shard
    # held once per replica: expert gradients summed over ep, then across the replicas
    "qwen3_moe_hsdp2x2_ep2": ("qwen3_moe", {"dp_replicate": 2, "dp_shard": 2, "ep": 2},
                              {"moe": {"aux_loss_coef": 0.0}}),
    # uneven shards: every row count of the tiny Qwen3 divides by 2, so dp_shard=2 alone splits
    # each evenly; 24-row groups (not a power of 2) make 64 rows 48 + 16, 32 rows 24 + 8, 512 rows
    # 264 + 248 and the 16-row norms 16 + 0 (an empty shard), in both replicas
    "qwen3_hsdp2x2_uneven": ("qwen3", {"dp_replicate": 2, "dp_shard": 2, "shard_geometry": "balanced", "align": 24},
                             {}),
    # pure replication with TP: shard groups of one rank (each replica holds whole TP-local weights)
    "qwen3_hsdp2_tp2": ("qwen3", {"dp_replicate": 2, "tp": 2}, {}),
    # two micro-batches a step, each one's gradients reduce-scattered (and all-reduced across the
    # replicas) into the shards, added there: no rank keeps whole gradients between them
    "qwen3_hsdp2x2_sync_every": ("qwen3", {"dp_replicate": 2, "dp_shard": 2, "sync_every_micro_batch": True},
                                 {"accumulate": 2}),
}
# MXFP8 rounds each element to 3 mantissa bits: the layouts' float32 sums in another order (1e-7
# apart) are the same FP8 values until one element sits on a rounding boundary and moves by an
# FP8 step: then that gradient is a few % apart (measured: in the second step with this seed,
# 2.6e-2 of the embedding's largest gradient; in the fourth with another AdamW eps). The MXFP8
# layout is compared on its first step, where its quantized values are the reference's.
COMPARED_MX = 1
PACKED = {"qwen3_cp4_ring", "qwen3_cp4_ulysses", "qwen3_cp2_dp2_ring", "qwen3_cp2_dp2_ulysses", "qwen3_tp2_dp2",
          "qwen3_tp2_sp_dp2_documents", "qwen3_moe_tp2_ep2_documents"}  # the others' rows end in padding


def config(layout: str | None, model: str | None = None) -> TrainConfig:
    model, parallel, other = LAYOUTS[layout] if layout else (model, {}, {})
    family, hf = MODELS[model]
    packed = layout in PACKED
    low_precision = other.get("low_precision", {})
    compile_ = other.get("compile", "none")
    raw = {"model": {"family": family, "config": hf},
           "data": {"seq_len": SEQ, "packing": packed},
           "training": {"global_batch": ROWS, "micro_batch": ROWS, "steps": STEPS, "max_grad_norm": 1.0,
                        "compile": compile_},
           "optimizer": {"name": "adamw", "lr": 1e-3, "eps": 1e-5},
           "parallel": parallel, "moe": other.get("moe", {}), "low_precision": low_precision}
    cfg = TrainConfig.model_validate(raw)
    data_ranks = 4 // cfg.parallel.model_parallel() if layout else 1  # dp_replicate x dp_shard
    micro = ROWS // data_ranks // other.get("accumulate", 1)
    return cfg.model_copy(update={"training": cfg.training.model_copy(update={"micro_batch": micro})})


def sequences(vocab: int, packed: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(1, vocab, (ROWS * STEPS, SEQ), generator=g)
    if not packed:  # documents of 20-32 tokens, padded
        for i, length in enumerate(torch.randint(20, SEQ + 1, (len(rows),), generator=g).tolist()):
            rows[i, length:] = PAD
    return rows


class PackedDocuments:
    """Rows of packed documents (3 per row, at offsets that vary by row), each document's
    positions restarting at 0 and its first label not trained: what data.PackedRows gives with
    document masks."""

    def __init__(self, sequences: torch.Tensor):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def row(self, i: int):
        ids = self.sequences[i].numpy().astype("int64")
        starts = np.asarray([7 + i % 5, 19 + i % 3])
        return (ids, *data.rows.labels_and_positions(ids, np.ones(SEQ, dtype=bool), starts, SEQ, SEQ, True))


def rows_of(layout: str | None, vocab: int):
    packed = layout in PACKED
    rows = sequences(vocab, packed)
    if layout is not None and LAYOUTS[layout][2].get("documents"):
        return PackedDocuments(rows)
    return data.TensorRows(rows, PAD, packed)


def whole(model, grads: bool = True) -> dict[str, torch.Tensor]:
    """Every gradient (or parameter) whole, from every rank's part placed by its checkpoint chunk."""
    tensors = {n: p.grad if grads else p for n, p in model.named_parameters() if not grads or p.grad is not None}
    chunks = shard_chunks(model, tensors, None)
    mine = {n: (chunks.get(f"model.{n}"), g.detach().clone()) for n, g in tensors.items()}
    if not dist.is_initialized():
        return {n: g for n, (_, g) in mine.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out_tensors = {}
    for name in mine:
        parts = [rank[name] for rank in everyone]
        chunk = parts[0][0]
        if chunk is None:
            out_tensors[name] = parts[0][1]
            continue
        out = torch.full(chunk.global_shape, float("nan"))
        for c, g in parts:
            if not c.empty:
                out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes, strict=True))] = g
        assert not out.isnan().any(), f"{name}: some elements are on no rank"
        out_tensors[name] = out
    return out_tensors


def train(cfg: TrainConfig, rt: Runtime, vocab: int, layout: str | None, save: Path | None = None):
    built = build_trained_model(cfg, rt, vocab)
    optimizer, scheduler = build_optimization(cfg, built.model)
    rank, replicas = built.mesh.dp_rank, built.mesh.dp_size
    batches = data.Batches(rows_of(layout, vocab), data.InOrder(ROWS * STEPS), ROWS, cfg.training.micro_batch, rank,
                           replicas)
    grads: list[dict] = []
    optimizer.register_step_pre_hook(lambda *_: grads.append(whole(built.model)))
    step = TrainStep(built, optimizer, scheduler, accumulation=cfg.grad_accumulation(rt.world), device=rt.device,
                     autocast_bf16=False, max_grad_norm=cfg.training.max_grad_norm,
                     sync_every_micro_batch=cfg.parallel.sync_every_micro_batch)
    losses = []
    for i in range(STEPS):
        result = step(batches.micro_batches(i))
        losses.append(agree(result.loss, 0.0, False).loss)
    if save is not None:
        checkpoint.save(save, built.model, optimizer, extra={"step": STEPS, MODEL_CARD: built.card.to_json()})
    return losses, grads, whole(built.model, grads=False)


def one_process(layout: str) -> TrainConfig:
    """The layout's config on one rank: its replicas' micro-batches one after the other (the loss
    is the mean of the micro-batches' means either way: the trainer's rule for any layout)."""
    cfg = config(layout)
    one = config(None, LAYOUTS[layout][0])
    return one.model_copy(update={"low_precision": cfg.low_precision, "moe": cfg.moe, "data": cfg.data,
                                  "training": cfg.training})


_references: dict[str, tuple] = {}


def reference(layout: str) -> tuple[list[float], list[dict], dict]:
    if layout not in _references:
        torch.manual_seed(0)
        with joined(60, torch.device("cpu")) as rt:
            _references[layout] = train(one_process(layout), rt, 512, layout)
    return _references[layout]


def on_ranks(rank: int, world: int, out: str) -> dict:
    """Every multi-rank case of this file and tests/dist/test_context_parallel.py, on one rank of
    the session's shared 4-rank spawn (tests/dist/spawn.py); the layouts' results on rank 0 (every
    rank gathered them)."""
    from tests.dist import test_context_parallel

    rt = Runtime(rank, world, torch.device("cpu"))
    mine = {"context_parallel": test_context_parallel.run_on_rank(rank, world), "mesh": mesh_groups_here(rank)}
    results = {}
    saves = {"qwen3_tp2_dp2": "tp2_checkpoint", "qwen3_hsdp2x2": "hsdp_checkpoint"}
    for layout in LAYOUTS:
        torch.manual_seed(0)
        save = Path(out) / saves[layout] if layout in saves else None
        results[layout] = train(config(layout), rt, 512, layout, save=save)

    def load_into(layout: str, parallel: dict | None, saved: str):
        cfg = config(layout)
        if parallel is not None:
            cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update=parallel)})
        built = build_trained_model(cfg, rt, 512)
        optimizer, _ = build_optimization(cfg, built.model)
        checkpoint.load(Path(out) / saved, built.model, optimizer)
        return built, optimizer

    # the tp=2 x dp_shard=2 checkpoint, loaded into other layouts: the same parameters everywhere
    loaded = {}
    for layout in ("qwen3_cp2_dp2_ring", "qwen3_tp4", "dp_shard=4"):
        parallel = {"tp": 1, "dp_shard": 4} if layout not in LAYOUTS else None
        built, _ = load_into(layout if layout in LAYOUTS else "qwen3_tp2_dp2", parallel, "tp2_checkpoint")
        loaded[layout] = whole(built.model, grads=False)
    # the dp_replicate=2 x dp_shard=2 checkpoint at dp_shard=4, saved again from there: its bytes
    # are the HSDP checkpoint's (each shard written by one replica only)
    built, optimizer = load_into("qwen3_hsdp2x2", {"dp_replicate": 1, "dp_shard": 4}, "hsdp_checkpoint")
    loaded["hsdp at dp_shard=4"] = whole(built.model, grads=False)
    checkpoint.save(Path(out) / "hsdp_as_dp_shard4", built.model, optimizer,
                    extra={"step": STEPS, MODEL_CARD: built.card.to_json()})
    uneven = build_trained_model(config("qwen3_hsdp2x2_uneven"), rt, 512).model
    mine["uneven rows"] = {name: shard_info(p).length for name, p in uneven.named_parameters()}
    return {**mine, "runs": results, "loaded": loaded} if rank == 0 else mine


def mesh_groups_here(rank: int) -> dict:
    """This rank's groups of a dp_replicate=2 x dp_shard=2 (x ep=2) mesh as build_mesh made them, and its data-parallel rank."""
    from hyperparallel.parallel.mesh import MeshShape, build_mesh

    names = ("tp", "cp", "fsdp", "replicate", "ep", "expert_shard", "world")
    mesh = build_mesh(MeshShape(dp_shard=2, ep=2, dp_replicate=2))
    groups = {name: dist.get_process_group_ranks(getattr(mesh, f"{name}_group")) for name in names}
    alone = build_mesh(MeshShape())  # one rank's mesh inside the 4-rank group (a reference built on a rank)
    return {"groups": groups, "dp_rank": mesh.dp_rank, "dp_size": mesh.dp_size,
            "alone": {name: dist.get_process_group_ranks(getattr(alone, f"{name}_group")) for name in names}}


def trainer_runs(rank: int, world: int, out: str) -> dict:
    """`hyperparallel train`'s loop in the shared 4-rank spawn's ranks (it joins their process
    group; tests/dist/spawn.py runs it after every other part): 4 steps at tp=2 (sequence
    parallel) x dp_shard=2 with validation every 2 steps and a checkpoint at step 2; then a run
    at cp=2 (ring) x dp_replicate=2 (HSDP: FSDP over each cp pair, 2 replicas) that resumes from
    that checkpoint."""
    from hyperparallel.train.config import from_mapping
    from hyperparallel.train.loop import train as train_loop
    from tests.train.test_cli_train import tiny_raw

    os.environ.update(LOCAL_RANK=str(rank), HYPERPARALLEL_CACHE=os.path.join(out, "cache"))
    runs = {}
    for name, parallel, resume in (("tp", {"tp": 2, "dp_shard": 2, "sequence_parallel": True}, "none"),
                                   ("cp", {"cp": 2, "dp_replicate": 2},
                                    str(Path(out) / "tp" / "checkpoints" / "step_00000002"))):
        raw = tiny_raw(Path(out) / name, eval_every=2)
        raw["parallel"] = parallel
        raw["checkpoint"] = {"every": 2, "resume": resume}
        raw["logging"].update(progress=False)
        with contextlib.redirect_stdout(io.StringIO()) as printed:
            runs[name] = train_loop(from_mapping(raw))
        runs[name]["printed"] = printed.getvalue()
    return runs


@pytest.fixture(scope="module")
def spawned(parallel_spawn_4) -> dict:
    return parallel_spawn_4


def _max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_one_process(spawned, layout):
    losses, grads, _ = spawned["runs"][layout]
    ref_losses, ref_grads, _ = reference(layout)
    if "mxfp8" in layout:
        losses, grads, ref_losses, ref_grads = (x[:COMPARED_MX] for x in (losses, grads, ref_losses, ref_grads))
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    worst_grad = max(_max_rel(g[n], r[n]) for g, r in zip(grads, ref_grads, strict=True) for n in r)
    print(f"{layout}: losses {worst_loss:.2e} relative, gradients {worst_grad:.2e} of their largest element "
          f"(max over {len(losses)} steps)")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for step, (g, r) in enumerate(zip(grads, ref_grads, strict=True)):
        assert g.keys() == r.keys()
        for name in r:  # within 1e-5 of the tensor's largest element (measured: at most 4.5e-6)
            assert _max_rel(g[name], r[name]) <= 1e-5, f"step {step} {name}: {_max_rel(g[name], r[name]):.2e}"


def test_the_uneven_hsdp_layout_has_uneven_and_empty_shards_in_both_replicas(spawned):
    rows = [result["uneven rows"] for result in spawned["per_rank"]]
    assert rows[0] == rows[2] and rows[1] == rows[3]  # replica 1 holds replica 0's shards
    assert (rows[0]["model.embed_tokens.weight"], rows[1]["model.embed_tokens.weight"]) == (264, 248)
    assert (rows[0]["model.layers.0.self_attn.q_proj.weight"], rows[1]["model.layers.0.self_attn.q_proj.weight"]) == (48, 16)
    assert (rows[0]["model.layers.0.self_attn.q_norm.weight"], rows[1]["model.layers.0.self_attn.q_norm.weight"]) == (16, 0)


def assert_loads_in_one_process(layout: str, directory: Path, saved: dict[str, torch.Tensor]) -> None:
    """The checkpoint `layout`'s run saved in `directory`, loaded by one process: the saved values."""
    cfg = one_process(layout)
    with joined(60, torch.device("cpu")) as rt:
        built = build_trained_model(cfg, rt, 512)
        optimizer, _ = build_optimization(cfg, built.model)
        checkpoint.load(directory, built.model, optimizer)
    for name, p in built.model.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def test_tp_checkpoint_loads_into_other_layouts_and_exports(spawned, tmp_path):
    """Saved at tp=2 x dp_shard=2: loaded at cp=2 x dp_shard=2, at tp=4, at dp_shard=4 and in one process, the
    values are the saved run's, and the Hugging Face export loads back with from_pretrained."""
    saved = spawned["runs"]["qwen3_tp2_dp2"][2]
    for layout, values in spawned["loaded"].items():
        if layout.startswith("hsdp"):
            continue  # (the next test's)
        assert values.keys() == saved.keys(), layout
        for name in saved:
            assert torch.equal(values[name], saved[name]), f"{layout}: {name}"
    assert_loads_in_one_process("qwen3_tp2_dp2", spawned["dir"] / "tp2_checkpoint", saved)
    # and the run itself is the one-process run's, to the layouts' tolerance
    for name, value in reference("qwen3_tp2_dp2")[2].items():
        assert _max_rel(saved[name], value) <= 1e-5, name
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(export_hf(spawned["dir"] / "tp2_checkpoint", tmp_path / "hf"))
    for name, p in exported.named_parameters():
        assert torch.equal(p.detach(), saved[name]), name


def _stored(directory: Path) -> tuple[int, int, int, int]:
    """(bytes of the directory's files, chunks, elements in the chunks, elements of the tensors)."""
    import math

    from hyperparallel.checkpoint.storage import SafeFileSystemReader

    tensors = [e for e in SafeFileSystemReader(str(directory)).read_metadata().state_dict_metadata.values()
               if hasattr(e, "chunks")]
    return (sum(f.stat().st_size for f in directory.rglob("*") if f.is_file()),
            sum(len(e.chunks) for e in tensors), sum(math.prod(c.sizes) for e in tensors for c in e.chunks),
            sum(math.prod(e.size) for e in tensors))


def test_an_hsdp_checkpoint_holds_each_shard_once_and_loads_at_dp_shard_4_and_in_one_process(spawned):
    """Saved at dp_replicate=2 x dp_shard=2: loaded at dp_shard=4 and in one process, the values are
    the saved run's; and it holds every element once, as the same state saved at dp_shard=4 does
    (the replicas' identical chunks are written once: DCP's save planner keeps one of equal
    chunks, on whichever rank has written least so far)."""
    saved = spawned["runs"]["qwen3_hsdp2x2"][2]
    at_dp4 = spawned["loaded"]["hsdp at dp_shard=4"]
    assert at_dp4.keys() == saved.keys()
    for name in saved:
        assert torch.equal(at_dp4[name], saved[name]), name
    assert_loads_in_one_process("qwen3_hsdp2x2", spawned["dir"] / "hsdp_checkpoint", saved)
    hsdp, dp4 = _stored(spawned["dir"] / "hsdp_checkpoint"), _stored(spawned["dir"] / "hsdp_as_dp_shard4")
    print(f"checkpoint: dp_replicate=2 x dp_shard=2 {hsdp[0]:,} bytes in {hsdp[1]} chunks, dp_shard=4 {dp4[0]:,} bytes "
          f"in {dp4[1]} chunks, {hsdp[3]:,} elements in each")
    for stored in (hsdp, dp4):
        assert stored[2] == stored[3]  # every element once: no chunk written by both replicas
    # the same elements in half the chunks (2 shards a tensor, not 4; each chunk costs ~1.6 kB of
    # framing, a tenth of these tiny tensors): measured 1,975,866 + metadata vs 2,206,108 + metadata
    assert hsdp[0] <= dp4[0]


def test_the_mesh_groups_are_those_its_pure_function_lists(spawned):
    """What build_mesh made on each rank at dp_replicate=2 x dp_shard=2, ep=2 is MeshShape.groups'
    group holding that rank, and those are the layout's: shard groups [0, 1] [2, 3], replica
    groups [0, 2] [1, 3], the experts split within each shard group, every other axis one rank."""
    from hyperparallel.parallel.mesh import MeshShape

    pure = MeshShape(dp_shard=2, ep=2, dp_replicate=2).groups()
    names = {"replicate": "dp_replicate"}
    expected = {"fsdp": [[0, 1], [2, 3]], "dp_replicate": [[0, 2], [1, 3]], "ep": [[0, 1], [2, 3]],
                "expert_shard": [[0], [1], [2], [3]], "tp": [[0], [1], [2], [3]], "cp": [[0], [1], [2], [3]]}
    assert {name: pure[name] for name in expected} == expected
    for rank, result in enumerate(spawned["per_rank"]):
        for name, ranks in result["mesh"]["groups"].items():
            if name == "world":
                assert ranks == [0, 1, 2, 3]
                continue
            assert ranks == next(g for g in pure[names.get(name, name)] if rank in g), (rank, name)
        assert result["mesh"]["dp_rank"] == rank and result["mesh"]["dp_size"] == 4
        # a one-rank mesh inside the larger group: every axis a group of this rank alone
        assert all(ranks == [rank] for ranks in result["mesh"]["alone"].values()), rank


def test_the_trainer_runs_tp_then_resumes_at_cp(spawned):
    """The trainer's loop end to end: a tp=2 (SP) x dp_shard=2 run with validation and
    checkpoints, and a cp=2 x dp_replicate=2 run resuming from its step-2 checkpoint: the resumed
    steps' losses and the validation loss are the tp run's."""
    runs = spawned["trainer"]
    tp, cp = (Path(runs[name]["run_dir"]) for name in ("tp", "cp"))
    # the run summary names the layout that ran (FSDP's geometry where it shards), and the TP plan by placement
    assert ("layout: 4 ranks: dp_shard 2 x tp 2 (sequence parallel); FSDP over 2 ranks (chunk, align 1)\n"
            in runs["tp"]["printed"])
    assert "o_proj: row-parallel over heads" in runs["tp"]["printed"]
    assert ("layout: 4 ranks: dp_replicate 2 (HSDP) x cp 2 (ring attention); FSDP over 2 ranks (chunk, align 1)\n"
            in runs["cp"]["printed"])
    assert ("HSDP: 2 replicas x FSDP over 2 rank(s); shard groups [0, 1] [2, 3]; replica groups [0, 2] [1, 3]"
            in runs["cp"]["printed"])

    def records(run_dir):
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    tp_loss = {r["step"]: r["loss"] for r in records(tp) if "loss" in r}
    cp_loss = {r["step"]: r["loss"] for r in records(cp) if "loss" in r}
    assert sorted(tp_loss) == [1, 2, 3, 4] and sorted(cp_loss) == [3, 4]
    for step in (3, 4):  # measured: equal
        assert cp_loss[step] == pytest.approx(tp_loss[step], rel=1e-6)
    tp_val = [r["val_loss"] for r in records(tp) if "val_loss" in r]
    cp_val = [r["val_loss"] for r in records(cp) if "val_loss" in r]
    assert len(tp_val) == 2 and len(cp_val) == 1
    assert cp_val[0] == pytest.approx(tp_val[1], rel=1e-6)  # measured: 9.6e-8 relative
    # the tokens the validation loss was taken over, each once (one global batch of 4 x 31 targets),
    # though each batch is read by the 2 tp (or cp) ranks of its replica
    assert [r["val_tokens"] for run in (tp, cp) for r in records(run) if "val_tokens" in r] == [4 * 31] * 3
