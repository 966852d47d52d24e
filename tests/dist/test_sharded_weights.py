"""A model built on the meta device and filled rank by rank, on 4 gloo ranks: the seeded init
and the weights read from a Hugging Face directory are the one-process model's, on every layout.

Layouts: dp_shard=4 (FSDP, uneven rows), tp=2 x dp_shard=2 (heads, MLP columns and a
row-parallel weight's columns), and Qwen3-MoE at dp_shard=4 x ep=2 (each rank's experts).
- The init: every tensor, assembled from the ranks' parts by the chunk each records for
  checkpoints, equals the one-process build bit for bit.
- model.path: a directory that save_pretrained wrote in several files; one step at lr 0 has the
  one-process run's loss (1e-5 relative), and the checkpoint of that step exports to a directory
  whose tensors equal the original files' exactly.
Run by the session's shared 4-rank spawn (tests/dist/spawn.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from hyperparallel import checkpoint
from hyperparallel.checkpoint.export import export_hf
from hyperparallel.checkpoint.model_card import KEY as MODEL_CARD
from hyperparallel.models import build_model
from hyperparallel.train import data
from hyperparallel.train.build import build_optimization, build_trained_model
from hyperparallel.train.config import TrainConfig
from hyperparallel.train.distributed import Runtime, agree, joined
from hyperparallel.train.step import TrainStep
from tests.dist.test_parallel_layouts import MODELS, PAD, ROWS, SEQ, whole

LAYOUTS = {
    "dp4": ("qwen3", {"dp_shard": 4}),
    "tp2_dp2": ("qwen3", {"tp": 2, "dp_shard": 2}),
    "moe_ep2": ("qwen3_moe", {"dp_shard": 4, "ep": 2}),
}


def config(model: str, parallel: dict, path: Path | None = None) -> TrainConfig:
    family, hf = MODELS[model]
    source = {"path": str(path)} if path is not None else {"config": hf}
    return TrainConfig.model_validate({
        "model": {"family": family, **source},
        "data": {"seq_len": SEQ, "packing": True},
        "training": {"global_batch": ROWS, "micro_batch": ROWS // parallel.get("dp_shard", 1), "steps": 1,
                     "compile": "none"},
        "optimizer": {"name": "adamw", "lr": 0.0},
        "parallel": parallel,
        "moe": {"aux_loss_coef": 0.0},  # (a per-rank loss by design: tests/dist/test_parallel_layouts.py)
    })


def hf_dir(part_dir: str | Path, model: str) -> Path:
    return Path(part_dir) / f"hf_{model}"


def before_ranks(out: str) -> None:
    """The Hugging Face directories the ranks load: each model with seeded weights, in several files."""
    for model in ("qwen3", "qwen3_moe"):
        family, hf = MODELS[model]
        build_model(family, config=hf, seed=3).save_pretrained(hf_dir(out, model), max_shard_size="100KB")


def one_step(cfg: TrainConfig, rt: Runtime, save: Path | None = None) -> float:
    """The step-1 loss at lr 0 (and its checkpoint in `save`)."""
    built = build_trained_model(cfg, rt, 512)
    optimizer, scheduler = build_optimization(cfg, built.model)
    rank, replicas = built.mesh.dp_rank, built.mesh.dp_size
    g = torch.Generator().manual_seed(7)
    rows = torch.randint(1, 512, (ROWS, SEQ), generator=g)
    batches = data.Batches(data.TensorRows(rows, PAD), data.InOrder(ROWS), ROWS, cfg.training.micro_batch, rank, replicas)
    step = TrainStep(built, optimizer, scheduler, accumulation=cfg.grad_accumulation(rt.world),
                     device=rt.device, autocast_bf16=False, max_grad_norm=cfg.training.max_grad_norm)
    loss = agree(step(batches.micro_batches(0)).loss, 0.0, False).loss
    if save is not None:
        checkpoint.save(save, built.model, optimizer, extra={"step": 1, MODEL_CARD: built.card.to_json()})
    return loss


def on_ranks(rank: int, world: int, out: str) -> dict:
    rt = Runtime(rank, world, torch.device("cpu"))
    initial, losses = {}, {}
    for layout, (model, parallel) in LAYOUTS.items():
        torch.manual_seed(0)
        initial[layout] = whole(build_trained_model(config(model, parallel), rt, 512).model, grads=False)
        losses[layout] = one_step(config(model, parallel, hf_dir(out, model)), rt,
                                  save=Path(out) / f"{layout}_checkpoint")
    return {"initial": initial, "losses": losses} if rank == 0 else {}


@pytest.fixture(scope="module")
def spawned(spawn_4, spawn_dir) -> dict:
    return {**spawn_4["weights"][0], "dir": spawn_dir / "weights"}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_sharded_init_equals_one_process_tensor_by_tensor(spawned, layout):
    model, parallel = LAYOUTS[layout]
    with joined(60, torch.device("cpu")) as rt:
        one = whole(build_trained_model(config(model, {}), rt, 512).model, grads=False)
    sharded = spawned["initial"][layout]
    assert sharded.keys() == one.keys()
    for name in one:
        assert torch.equal(sharded[name], one[name]), name


@pytest.mark.parametrize("model", ["qwen3", "qwen3_moe"])  # (qwen3 ties its output head to the embedding)
def test_the_trainers_init_equals_build_model_with_the_seed(model):
    """Every parameter and buffer the trainer's build fills from the init (one module at a time
    on the meta-built model) equals the model build_model initializes whole with the same seed."""
    family, hf = MODELS[model]
    with joined(60, torch.device("cpu")) as rt:
        built = build_trained_model(config(model, {}), rt, 512).model
    reference = build_model(family, config=hf, seed=0)  # (training.seed's default)
    for mine, theirs in ((built.named_parameters(), reference.named_parameters()),
                         (built.named_buffers(), reference.named_buffers())):
        mine, theirs = dict(mine), dict(theirs)
        assert mine.keys() == theirs.keys()
        for name in theirs:
            assert torch.equal(mine[name].detach(), theirs[name].detach()), name


def _files(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loading_a_multi_file_hf_directory_sharded_equals_one_process_and_exports_the_same_tensors(
        spawned, layout, tmp_path):
    model, parallel = LAYOUTS[layout]
    source = hf_dir(spawned["dir"], model)
    assert len(list(source.glob("*.safetensors"))) > 1  # several files, each rank reading its parts of them
    with joined(60, torch.device("cpu")) as rt:
        one = one_step(config(model, {}, source), rt)
    assert spawned["losses"][layout] == pytest.approx(one, rel=1e-5)
    exported = _files(export_hf(spawned["dir"] / f"{layout}_checkpoint", tmp_path / "hf"))
    original = _files(source)
    assert exported.keys() == original.keys()
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key
