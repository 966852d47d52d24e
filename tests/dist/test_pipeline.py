"""Pipeline parallelism (parallel.pp) in the trainer's own build and step, on 4 gloo ranks, against
one process training the same model on the same global batch (losses measured within 1e-7
relative of one process's; the issue asks 1e-5).

Every layout builds with `build_trained_model` (the stages cut on the meta device, FSDP over each
stage's ranks, TP / EP where named) and runs STEPS `TrainStep`s (fp32, AdamW, clipping at 1.0,
a constant lr) through torch.distributed.pipelining's schedule; its losses (the mean over the
ranks, as the trainer logs it) and final parameters (whole, assembled from every rank's part by
the chunk each records for checkpoints) are compared with one process's. A tuned family (Qwen3)
runs at pp=2 x dp_shard=2 and at pp=4 (an interleaved schedule, 2 stages a rank), and one
transformers' own class alone describes (Llama) at pp=4 (GPipe); Qwen3 at pp=2 x tp=2 and pp=2 x cp=2 (ring,
Ulysses: tests/dist/test_context_parallel.py has both modes); Qwen3-MoE at pp=2 x ep=2.
MoE load balancing across stages: Qwen3-MoE with its auxiliary loss (each stage's routers' part
differentiated where the stage runs), DeepSeek-V3 moving its correction biases with its stages
interleaved (a rank holds layers 0 and 2); their figures (the auxiliary loss, each layer's
imbalance in the model's order) and biases must be one process's too.

The plan: `hyperparallel plan`'s tensors for each pipeline rank against the allocator's peak of
each rank's third step, in every layout above.

A head tied to the embedding (Qwen3's tiny config ties them): the first and last stages each
hold the weight and sum their gradients, at pp=2 x dp_shard=2, pp=2 x tp=2 and pp=4.

Resume across layouts: the Qwen3 pp=2 x dp_shard=2 runs, untied and tied, save a checkpoint after
3 steps (model and optimizer); a run at pp=1 (dp_shard=4) loads the untied one and a run at pp=4
the tied one, and they train steps 4 and 5, whose losses must be the uninterrupted run's.

Build peak: the 8-layer Qwen3 built at pp=4 (2 layers a stage), from the init and from model.path
(a Hugging Face directory saved before the spawn), holds on each rank at most its own stage plus
one tensor: the most tensor bytes alive during `build_trained_model`, from the CPU allocator's
events as the profiler records them (tests/train/test_plan.py measures a step so).
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hyperparallel import checkpoint, traffic
from hyperparallel.checkpoint.model_card import KEY as MODEL_CARD
from hyperparallel.checkpoint.sharded import shard_chunks
from hyperparallel.models import build_model
from hyperparallel.moe.balance import read_figures
from hyperparallel.train import data, planning
from hyperparallel.train.build import build_optimization, build_trained_model
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime, agree, joined
from hyperparallel.train.step import TrainStep
from tests.allocator import allocator_peak
from tests.dist.test_parallel_layouts import rows_of, tiny

STEPS, SAVED_AT, MEASURED = 5, 3, 2  # (MEASURED: the step whose memory peak is compared with the plan's)
ROWS, SEQ, MICRO = 8, 32, 2  # the global batch, its sequences' length, and rows per micro-batch
VOCAB = 512

MODELS = {
    "qwen3": ("qwen3", tiny("qwen3_tiny.yaml", tie_word_embeddings=False, num_hidden_layers=4)),
    "qwen3_8": ("qwen3", tiny("qwen3_tiny.yaml", tie_word_embeddings=False, num_hidden_layers=8)),
    "qwen3_tied": ("qwen3", tiny("qwen3_tiny.yaml", num_hidden_layers=4)),  # (its head is its embedding)
    # MXFP8's blocks of 32 along each product's dims: 4 kv heads of 16
    "qwen3_kv4": ("qwen3", tiny("qwen3_tiny.yaml", tie_word_embeddings=False, num_hidden_layers=4,
                                num_key_value_heads=4)),
    "llama": ("llama", {"model_type": "llama", "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128,
                        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                        "head_dim": 16}),
    "qwen3_moe": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml")),
    "qwen3_moe_4": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml", num_hidden_layers=4)),
    "deepseek_v3": ("deepseek_v3", tiny("deepseek_v3_tiny.yaml", num_hidden_layers=4)),
}
# the MoE load balancing each model trains with (the others: none at all)
BALANCING = {"qwen3_moe_4": {"aux_loss_coef": 0.01}, "deepseek_v3": {"bias_update_rate": 0.01}}
LAYOUTS = {
    "qwen3_pp2_dp2": ("qwen3", {"pp": 2, "dp_shard": 2}),
    "qwen3_pp2_tp2": ("qwen3", {"pp": 2, "tp": 2}),
    # each rank its part of every sequence inside each stage (ring attention)
    "qwen3_pp2_cp2_ring": ("qwen3", {"pp": 2, "cp": 2, "cp_mode": "ring"}),
    # the tied weight held by the first and the last stage (pp=4: the middle ones hold neither)
    "qwen3_tied_pp2_dp2": ("qwen3_tied", {"pp": 2, "dp_shard": 2}),
    "qwen3_tied_pp4": ("qwen3_tied", {"pp": 4}),
    "qwen3_tied_pp2_tp2": ("qwen3_tied", {"pp": 2, "tp": 2}),
    "qwen3_moe_pp2_ep2": ("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2}),
    # each stage's routers' auxiliary loss; DeepSeek-V3's correction biases, its stages interleaved
    # (a rank holds layers 0 and 2, the other 1 and 3)
    "qwen3_moe_aux_pp2_dp2": ("qwen3_moe_4", {"pp": 2, "dp_shard": 2}),
    # a stage without a MoE layer (the dense first layer alone): its rank balances with the others
    "deepseek_v3_bias_pp2_dp2_dense_stage": ("deepseek_v3", {"pp": 2, "dp_shard": 2, "pp_layers": [1, 3]}),
    "deepseek_v3_bias_pp2_dp2_interleaved": ("deepseek_v3", {"pp": 2, "dp_shard": 2, "pp_schedule": "interleaved_1f1b",
                                                             "pp_virtual_stages": 2}),
    "qwen3_pp4_interleaved": ("qwen3_8", {"pp": 4, "pp_schedule": "interleaved_1f1b", "pp_virtual_stages": 2}),
    "llama_pp4_gpipe": ("llama", {"pp": 4, "pp_schedule": "gpipe"}),
}
# the pp=2 x dp_shard=2 checkpoints (untied, and tied: one weight saved by two stages) resumed at
# another pp
SAVED = ("qwen3_pp2_dp2", "qwen3_tied_pp2_dp2")
# what a pipeline composes with, each against one plain process (recompute, compiled layers (DVM)
# and MegaMoE's waves compute the same values), MXFP8 against one process in MXFP8 (compared on
# its first step, where its quantized values are the reference's: tests/dist/test_parallel_layouts.py)
MX = {"low_precision": {"enabled": True}}
COMPOSED = {
    "recompute full": ("qwen3", {"pp": 2, "dp_shard": 2, "recompute": "full"}, {}),
    "compile dvm": ("qwen3", {"pp": 2, "dp_shard": 2}, {"training": {"compile": "dvm"}}),
    "megamoe": ("qwen3_moe", {"pp": 2, "dp_shard": 2, "ep": 2}, {"moe": {"implementation": "megamoe"}}),
    "mxfp8": ("qwen3_kv4", {"pp": 2, "dp_shard": 2}, MX),
}
# (the untied one at pp=1, the tied one at pp=4: each saved checkpoint, each way of resharding)
RESUMED = {"qwen3_pp2_dp2 at pp=1 (dp_shard=4)": ("qwen3_pp2_dp2", {"dp_shard": 4}),
           "qwen3_tied_pp2_dp2 at pp=4": ("qwen3_tied_pp2_dp2", {"pp": 4})}


def config(model: str, parallel: dict, path: Path | None = None, sections: dict | None = None) -> TrainConfig:
    """`sections`: config sections merged into the run's (COMPOSED's)."""
    family, hf = MODELS[model]
    source = {"path": str(path)} if path is not None else {"config": hf}
    raw = {
        "model": {"family": family, **source}, "data": {"seq_len": SEQ},
        "training": {"global_batch": ROWS, "micro_batch": MICRO, "steps": STEPS, "max_grad_norm": 1.0,
                     "compile": "none"},
        "optimizer": {"name": "adamw", "lr": 1e-3, "eps": 1e-5},
        "scheduler": {"kind": "constant", "warmup_steps": 0},
        "moe": BALANCING.get(model, {"aux_loss_coef": 0.0}), "parallel": parallel}
    for section, values in (sections or {}).items():
        raw[section] = {**raw.get(section, {}), **values}
    return TrainConfig.model_validate(raw)


def whole_parameters(model) -> dict[str, torch.Tensor]:
    """Every parameter whole, from the parts the ranks hold (each stage's ranks hold its own), and
    the MoE routers' correction biases."""
    tensors = dict(model.named_parameters())
    tensors |= {n: b for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")}
    chunks = shard_chunks(model, tensors, None)
    mine = {n: (chunks.get(f"model.{n}"), p.detach().clone()) for n, p in tensors.items()}
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return {n: p for n, (_, p) in mine.items()}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for rank in everyone:
        for name, (chunk, part) in rank.items():
            if chunk is None:
                out[name] = part
                continue
            whole = out.setdefault(name, torch.full(chunk.global_shape, float("nan")))
            if not chunk.empty:
                whole[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes, strict=True))] = part
    return out


def train(cfg: TrainConfig, rt: Runtime, steps: range, *, load: Path | None = None, save: Path | None = None,
          peaks: list | None = None):
    """`peaks`: given, the tensor bytes of step MEASURED's peak are appended to it (what the rank
    holds before the step, parameters, buffers and optimizer state, plus the most the step adds)."""
    built = build_trained_model(cfg, rt, VOCAB)
    optimizer, scheduler = build_optimization(cfg, built.model)
    if load is not None:
        checkpoint.load(load, built.model, optimizer)
    batches = data.Batches(rows_of(None, VOCAB), data.InOrder(ROWS * STEPS), ROWS, MICRO, built.mesh.dp_rank,
                           built.mesh.dp_size)
    step = TrainStep(built, optimizer, scheduler, accumulation=cfg.grad_accumulation(rt.world), device=rt.device,
                     autocast_bf16=False, max_grad_norm=cfg.training.max_grad_norm)
    losses, figures = [], []
    for i in steps:
        measured = peaks is not None and i == MEASURED  # (its optimizer state exists: a steady-state step)
        if measured:
            state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            held = tensor_bytes((*built.model.parameters(), *built.model.buffers(), *state))
        with allocator_peak() if measured else nullcontext() as peak, traffic.counting() as counted:
            result = step(batches.micro_batches(i))
        losses.append(agree(result.loss, 0.0, False).loss)
        figures.append(read_figures(result.moe))
        if "aux_loss" in figures[-1] and dist.is_initialized():  # (each rank's own rows: their mean, as the loss's)
            mean = torch.tensor(figures[-1]["aux_loss"], dtype=torch.float64)
            dist.all_reduce(mean)
            figures[-1]["aux_loss"] = float(mean) / dist.get_world_size()
        if measured:
            peaks.append((held + peak[0], counted.to_json()["by_dimension_and_kind"]))
        if save is not None and i + 1 == SAVED_AT:
            checkpoint.save(save, built.model, optimizer, extra={"step": SAVED_AT, MODEL_CARD: built.card.to_json()})
    return losses, whole_parameters(built.model), figures


def hf_dir(out: str | Path) -> Path:
    return Path(out) / "hf_qwen3_8"


def before_ranks(out: str) -> None:
    """The Hugging Face directory the pp=4 build reads (model.path): the 8-layer Qwen3, seeded."""
    family, hf = MODELS["qwen3_8"]
    build_model(family, config=hf, seed=3).save_pretrained(hf_dir(out))


def tensor_bytes(tensors) -> int:
    """The bytes of `tensors`, each storage once (a tied parameter, a view)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if not t.is_meta}
    return sum(storages.values())


def build_peak(cfg: TrainConfig, rt: Runtime) -> dict[str, int]:
    """The most tensor bytes alive while `build_trained_model` builds this rank's model (the CPU
    allocator's own events, recorded by the profiler, as tests/train/test_plan.py measures a
    step), what the rank holds after it, and the whole model's bytes and largest tensor."""
    with allocator_peak() as peak:
        built = build_trained_model(cfg, rt, VOCAB)
    family, hf = MODELS["qwen3_8"]
    whole = build_model(family, config=hf, materialize=False)  # (on the meta device: shapes alone)
    sizes = [t.numel() * t.element_size() for t in (*whole.parameters(), *whole.buffers())]
    return {"peak": peak[0], "own": tensor_bytes((*built.model.parameters(), *built.model.buffers())),
            "largest": max(sizes), "whole": sum(sizes), "stages": list(built.pipeline.stages)}


def on_ranks(rank: int, world: int, out: str) -> dict:
    """Every layout and the resumed runs, on one rank of the shared 4-rank spawn; rank 0 returns
    them. Every rank returns its build peaks at pp=4 (from the init and from model.path)."""
    rt = Runtime(rank, world, torch.device("cpu"))
    torch.manual_seed(0)
    peaks = {"init": build_peak(config("qwen3_8", {"pp": 4}), rt),
             "model.path": build_peak(config("qwen3_8", {"pp": 4}, hf_dir(out)), rt)}
    results, step_peaks = {}, {}
    for name, (model, parallel) in LAYOUTS.items():
        torch.manual_seed(0)
        step_peaks[name] = []
        results[name] = train(config(model, parallel), rt, range(STEPS),
                              save=Path(out) / name if name in SAVED else None, peaks=step_peaks[name])
    composed = {}
    for name, (model, parallel, sections) in COMPOSED.items():
        torch.manual_seed(0)
        composed[name] = train(config(model, parallel, sections=sections), rt, range(STEPS))
    resumed = {}
    for name, (layout, parallel) in RESUMED.items():
        torch.manual_seed(0)
        resumed[name] = train(config(LAYOUTS[layout][0], parallel), rt, range(SAVED_AT, STEPS),
                              load=Path(out) / layout)[0]
    return {"peaks": peaks, "step_peaks": step_peaks, **({"runs": results, "resumed": resumed, "composed": composed} if rank == 0 else {})}


_references: dict[str, tuple] = {}


def reference(model: str, mx: bool = False) -> tuple[list[float], dict, list[dict]]:
    if (model, mx) not in _references:
        torch.manual_seed(0)
        with joined(60, torch.device("cpu")) as rt:
            _references[model, mx] = train(config(model, {}, sections=MX if mx else None), rt, range(STEPS))
    return _references[model, mx]


@pytest.fixture(scope="module")
def spawned(spawn_4) -> dict:
    return spawn_4["pipeline"][0]


@pytest.fixture(scope="module")
def build_peaks(spawn_4) -> list[dict]:
    return [rank["peaks"] for rank in spawn_4["pipeline"]]


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipeline_layout_equals_one_process(spawned, layout):
    losses, params, figures = spawned["runs"][layout]
    ref_losses, ref_params, ref_figures = reference(LAYOUTS[layout][0])
    # the MoE balancing's figures: the auxiliary loss (every stage's part) and each layer's
    # imbalance, in the model's layer order (measured: the same to 1e-9 and exactly)
    for got, ref in zip(figures, ref_figures, strict=True):
        assert got.keys() == ref.keys(), (layout, got, ref)
        if "aux_loss" in ref:
            assert _rel(got["aux_loss"], ref["aux_loss"]) < 1e-6, (layout, got, ref)
        if "moe_imbalance_per_layer" in ref:
            assert got["moe_imbalance_per_layer"] == ref["moe_imbalance_per_layer"], (layout, got, ref)
    assert len(losses) == STEPS
    worst = max(_rel(a, b) for a, b in zip(losses, ref_losses, strict=True))
    assert worst < 1e-5, (layout, losses, ref_losses)
    assert params.keys() == ref_params.keys()
    for name, ref in ref_params.items():
        assert not params[name].isnan().any(), f"{layout}: {name} is on no rank"
        # (measured: at most 4.9e-6 of a tensor's largest value after 5 AdamW steps)
        assert float((params[name] - ref).abs().max() / ref.abs().max()) < 5e-5, f"{layout}: {name}"


@pytest.mark.parametrize("composed", list(COMPOSED))
def test_a_pipeline_composes_with(spawned, composed):
    model, _, sections = COMPOSED[composed]
    losses, params, _ = spawned["composed"][composed]
    ref_losses, ref_params, _ = reference(model, mx=sections is MX)
    steps = 1 if sections is MX else STEPS
    # (measured: at most 5.7e-8 relative (DVM's fused layers); MXFP8's first step: equal)
    assert max(_rel(a, b) for a, b in zip(losses[:steps], ref_losses[:steps], strict=True)) < 1e-5, (
        composed, losses, ref_losses)
    if sections is not MX:  # (measured: at most 8.5e-6 of a tensor's largest value after 5 steps, DVM's)
        for name, ref in ref_params.items():
            assert float((params[name] - ref).abs().max() / ref.abs().max()) < 1e-4, f"{composed}: {name}"


@pytest.mark.parametrize("resumed", list(RESUMED))
def test_pp2_checkpoint_resumes_at_another_pp(spawned, resumed):
    uninterrupted = spawned["runs"][RESUMED[resumed][0]][0][SAVED_AT:]
    losses = spawned["resumed"][resumed]
    assert max(_rel(a, b) for a, b in zip(losses, uninterrupted, strict=True)) < 1e-5, (losses, uninterrupted)


@pytest.fixture(scope="module")
def step_peaks(spawn_4) -> list[dict]:
    return [rank["step_peaks"] for rank in spawn_4["pipeline"]]


_stage_plans: dict[str, list] = {}


def stage_plans(layout: str) -> list:
    """`hyperparallel plan`'s plan of each pipeline rank of `layout` (on 4 ranks), made once."""
    if layout not in _stage_plans:
        model, parallel = LAYOUTS[layout]
        cfg = config(model, parallel)
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"vocab_size": VOCAB})})
        stages = planning.model.pipeline_stages(cfg)
        _stage_plans[layout] = [planning.plan(cfg, 4, runtime=0, _stages=(stages, r)) for r in range(parallel["pp"])]
    return _stage_plans[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_of_each_pipeline_stage_is_near_its_measured_peak(step_peaks, layout):
    """`hyperparallel plan`'s tensors for each pipeline rank (its stages' model, its micro-batches
    in flight under the schedule, the schedule's buffers) against the tensor bytes each rank's
    steady-state step really holds at its peak (the CPU allocator's events; the issue asks 25%)."""
    stage_world = 4 // LAYOUTS[layout][1]["pp"]
    totals = [p.total for p in stage_plans(layout)]  # (the pipeline's plan's `pipeline.totals`: test_plan.py)
    measured = [rank[layout][0][0] for rank in step_peaks]
    for rank, peak in enumerate(measured):
        ratio = totals[rank // stage_world] / peak
        # measured (ranks 0-3): qwen3 pp2_dp2 0.99 1.00 1.04 1.09, (llama pp2_dp2 1.01 1.00 1.10 1.10),
        # pp2_tp2 1.03 1.01 1.07 1.09, tied pp2_dp2 0.99 1.02 1.04 1.09, tied pp4 0.94 0.95 0.93 1.03,
        # tied pp2_tp2 1.00 1.03 1.06 1.05, MoE pp2_ep2 0.92 0.91 (routing: the plan's is uniform, a
        # rank's experts received more) 0.98 1.00, MoE with its auxiliary loss 0.97 0.97 1.00 0.97,
        # DeepSeek-V3 interleaved 0.99 0.99 1.14 1.14, qwen3 pp4 interleaved 1.09 1.08 1.08 1.13,
        # llama pp4 GPipe 0.91 0.97 0.97 1.02, pp2_cp2 ring 0.98 0.98 1.06 1.06. (Planned as if every
        # micro-batch in flight met the whole accumulated gradients: 1.26 on llama pp2_dp2's rank 0.)
        # (the issue asks 25%; the MoE's rank 1 measured 0.85 once, in a full `make test`)
        assert 0.8 <= ratio <= 1.2, (layout, rank, ratio, totals, measured)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_plan_of_each_pipeline_stage_sends_what_it_counts(step_peaks, layout):
    """Each pipeline rank's planned bytes sent against what the trainer's counter counted on it
    (hyperparallel.traffic): the stage's sends (activations with ids, labels and positions on,
    gradients back), FSDP's collectives (the root gathered as the schedule frees it), TP's and
    CP's, to the byte; EP's within its routing (the plan's is uniform)."""
    stage_world = 4 // LAYOUTS[layout][1]["pp"]
    for rank, record in enumerate(step_peaks):
        counted = record[layout][0][1]
        planned = stage_plans(layout)[rank // stage_world].comm_by_dimension_and_kind
        assert set(counted) == set(planned), (layout, rank, counted, planned)
        for key, sent in planned.items():
            if not key.startswith("ep/"):
                assert counted[key] == sent, (layout, rank, key, counted[key], sent)
            else:  # (measured: EP's all-to-alls 0.97-1.03 of the plan's)
                assert counted[key] == pytest.approx(sent, rel=0.1), (layout, rank, key, counted[key], sent)


@pytest.mark.parametrize("weights", ["init", "model.path"])
def test_pp4_build_peak_is_the_ranks_stage_plus_one_tensor(build_peaks, weights):
    """Each rank's build (cut to its stage on the meta device, then given memory and filled) holds
    at its peak its own stage's parameters and buffers plus at most the one tensor being filled:
    no whole model, and no full parameter beside FSDP's shard (its group here is one rank)."""
    peaks = [rank[weights] for rank in build_peaks]
    assert [p["stages"] for p in peaks] == [[0], [1], [2], [3]]
    for rank, p in enumerate(peaks):
        # measured (init, model.path): ranks 0 and 3 1.0077x, 0.9999x (the embedding or the head
        # drawn whole, then copied into the rank's own); ranks 1 and 2 0.854x, 0.843x (a layer's
        # weight at a time, smaller than the head)
        assert p["peak"] <= 1.02 * (p["own"] + p["largest"]), (weights, rank, p)
        # measured: 0.36x (the first and last stages), 0.24x (the middle ones); 1.0x with every
        # layer held on every rank, 1.07x without hold_stages at all; 0.65x on the first and last
        # stages when FSDP's full parameters had memory beside the shards (then 1.81x the bound above)
        assert p["peak"] < 0.45 * p["whole"], (weights, rank, p)
