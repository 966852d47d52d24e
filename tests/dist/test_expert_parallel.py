"""Expert parallelism on 2 and 4 gloo ranks against one process on the same global batch.

The one-process reference is transformers' own model (its routers and eager experts loop), or,
for MXFP8 experts, one process running our MXFP8 experts. Each layout trains STEPS AdamW steps;
losses (the mean over ranks of each rank's mean) and every gradient of the first step are compared,
gradient shards by their recorded global offsets (`shard_info`), which also shows that every
expert is held exactly once over the ranks. fp32 throughout; the products sum in another order
than the eager loop: the losses measured 0.8-1.5e-7 relative apart, the tolerance is 1e-5.

The session's shared spawn of each world size (tests/dist/spawn.py) runs every case; the checkpoint
case saves at ep=2 and resumes at ep=4 and ep=1 on the same ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml

from hyperparallel import checkpoint
from hyperparallel.checkpoint import ModelCard
from hyperparallel.checkpoint.export import export_hf
from hyperparallel.checkpoint.model_card import KEY as MODEL_CARD
from hyperparallel.fsdp import shard_info
from hyperparallel.lowp import LowPrecisionConfig, convert
from hyperparallel.models import build_model
from hyperparallel.moe import LoadBalancer
from hyperparallel.optim import OptimizerConfig, build_optimizer
from hyperparallel.parallel import apply_expert_parallel, apply_recompute, expert_layout, shard_model

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
STEPS = 3
ROWS, SEQ = 8, 16  # the global batch: ROWS sequences (divides by 2 and 4)
TOL = {"rtol": 1e-5, "atol": 1e-6}
BIAS_RATE = 1e-2  # large enough that the bias changes the routing within a few steps


def tiny(name: str, **overrides) -> dict:
    config = yaml.safe_load((CONFIGS / name).read_text())
    config.update(overrides)
    return config


# (name, family, config, ep, options); every case runs at every world size its ep divides
CASES = {
    "qwen3_moe": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {}),
    "deepseek_v3_bias": ("deepseek_v3", tiny("deepseek_v3_tiny.yaml"), {"bias": True}),
    # 6 experts: 3 + 3 on 2 ranks, 2, 2, 1, 1 on 4
    "six_experts": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml", num_experts=6, num_experts_per_tok=2), {}),
    # a zero router with top-1: every score ties, every token goes to expert 0 (torch.topk keeps the
    # first of equals), and the other ranks' experts receive no tokens
    "one_expert": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml", num_experts_per_tok=1), {"zero_router": True}),
    "mxfp8": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"mx": True}),
    "recompute_full": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"recompute": "full"}),
    # Muon: each rank orthogonalizes the expert matrices it holds
    "muon": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"muon": True}),
    # MegaMoE (moe.implementation: megamoe) in 2 waves; with DeepSeek-V3's shared experts inside its graph
    "megamoe": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"waves": 2}),
    "megamoe_deepseek_v3": ("deepseek_v3", tiny("deepseek_v3_tiny.yaml"), {"bias": True, "waves": 2}),
    "megamoe_mxfp8": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"mx": True, "waves": 2}),
    "megamoe_recompute": ("qwen3_moe", tiny("qwen3_moe_tiny.yaml"), {"recompute": "full", "waves": 2}),
}
LAYOUTS = {2: [("qwen3_moe", 2), ("deepseek_v3_bias", 2), ("six_experts", 2), ("one_expert", 2), ("mxfp8", 2),
               ("recompute_full", 2), ("muon", 2), ("megamoe", 2), ("megamoe_deepseek_v3", 2), ("megamoe_mxfp8", 2),
               ("megamoe_recompute", 2)],
           4: [("qwen3_moe", 4), ("qwen3_moe", 2), ("six_experts", 4), ("one_expert", 4), ("mxfp8", 4),
               ("deepseek_v3_bias", 4), ("megamoe", 4)]}
# MegaMoE computes what the sequential layer does: its cases share the sequential cases' references
SAME_REFERENCE = {"megamoe": "qwen3_moe", "megamoe_deepseek_v3": "deepseek_v3_bias", "megamoe_mxfp8": "mxfp8",
                  "megamoe_recompute": "recompute_full"}
RUNS = [(world, case, ep) for world, layouts in LAYOUTS.items() for case, ep in layouts]


def global_batch(step: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(100 + step))


def build(case: str, *, ours: bool) -> torch.nn.Module:
    family, config, options = CASES[case]
    model = build_model(family, config=config, seed=0, grouped_experts=ours)
    if options.get("zero_router"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.zero_()
    if options.get("mx"):
        convert(model, LowPrecisionConfig(enabled=True, modules=["experts"]))
    apply_recompute(model, options.get("recompute", "off"))
    return model


def make_optimizer(model, case: str):
    if CASES[case][2].get("muon"):
        return build_optimizer(model, OptimizerConfig(name="muon", lr=1e-3, weight_decay=0.0))
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def hf_bias_update(model, loads: list[torch.Tensor]) -> None:
    """DeepSeek-V3's rule written out for transformers' routers: b += rate * sign(mean - load)."""
    routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
    with torch.no_grad():
        for router, load in zip(routers, loads, strict=True):
            load = load.double()
            router.e_score_correction_bias += BIAS_RATE * torch.sign(load.mean() - load).float()


def reference(case: str) -> dict:
    """One process, the global batch: transformers' modules (or our MXFP8 experts)."""
    options = CASES[case][2]
    model = build(case, ours=bool(options.get("mx")))
    loads: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda mod, args, out: loads.append(
        torch.bincount(out[2].reshape(-1), minlength=mod.num_experts if hasattr(mod, "num_experts") else 0)))
        for m in model.modules() if type(m).__name__ in ("Qwen3MoeTopKRouter", "DeepseekV3TopkRouter")]
    optimizer = make_optimizer(model, case)
    losses, grads = [], None
    for step in range(STEPS):
        ids = global_batch(step, model.config.vocab_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if grads is None:
            grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
        if options.get("bias"):
            hf_bias_update(model, loads)
        loads.clear()
    for hook in hooks:
        hook.remove()
    return {"losses": losses, "grads": grads}


def parallel_model(case: str, ep: int):
    model = build(case, ours=True)
    layout = expert_layout(ep) if ep > 1 else None
    options = CASES[case][2]
    if layout is not None:
        implementation = "megamoe" if "waves" in options else "sequential"
        apply_expert_parallel(model, layout, implementation=implementation, waves=options.get("waves", 1))
    shard_model(model, experts=layout)
    balancer = LoadBalancer(model, "bias" if options.get("bias") else "none", bias_update_rate=BIAS_RATE)
    return model, balancer


def train_steps(model, balancer, optimizer, rank: int, world: int, steps: range, grads: dict | None = None) -> list:
    losses = []
    per_rank = ROWS // world
    for step in steps:
        ids = global_batch(step, model.config.vocab_size)[rank * per_rank:(rank + 1) * per_rank]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        balancer.after_backward()
        if grads is not None and not grads:
            grads.update({name: (shard_info(p), p.grad.clone()) for name, p in model.named_parameters()
                          if p.grad is not None})
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        optimizer.step()
        balancer.after_step()
        optimizer.zero_grad()
    return losses


def run_case(rank: int, world: int, case: str, ep: int) -> dict:
    model, balancer = parallel_model(case, ep)
    optimizer = make_optimizer(model, case)
    grads: dict = {}
    losses = train_steps(model, balancer, optimizer, rank, world, range(STEPS), grads)
    return {"losses": losses, "grads": grads}


def run_checkpoint(rank: int, world: int, out_dir: str) -> dict:
    """Save at ep=2 after one step, go on uninterrupted; resume the save at ep=4 (on 4 ranks)
    and at ep=1."""
    path = Path(out_dir) / f"ep2-on-{world}"
    model, balancer = parallel_model("qwen3_moe", 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    first = train_steps(model, balancer, optimizer, rank, world, range(1))
    card = ModelCard.of("qwen3_moe", "float32", model.config)  # what `hyperparallel export` reads
    checkpoint.save(path, model, optimizer, extra={MODEL_CARD: card.to_json()})
    uninterrupted = first + train_steps(model, balancer, optimizer, rank, world, range(1, STEPS))
    resumed = {}
    for ep in (4, 1) if world == 4 else (1,):
        model, balancer = parallel_model("qwen3_moe", ep)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        checkpoint.load(path, model, optimizer)
        resumed[ep] = train_steps(model, balancer, optimizer, rank, world, range(1, STEPS))
    return {"uninterrupted": uninterrupted, "resumed": resumed, "path": str(path)}


def on_ranks(rank: int, world: int, out_dir: str) -> dict:
    """Every multi-rank MoE case of one world size, on one rank of the session's shared spawn
    (tests/dist/spawn.py): this file's, the dispatcher's alone (tests/dist/test_moe_dispatch.py,
    4 ranks), the MX dispatch's (tests/dist/test_mx_dispatch.py, 2 ranks), the bias balancing's
    (tests/moe/test_router.py, 2 ranks) and a traced task graph's (tests/multicore/test_trace.py,
    2 ranks)."""
    from tests.dist import test_moe_dispatch, test_mx_dispatch
    from tests.moe import test_router
    from tests.multicore import test_trace

    results = {(case, ep): run_case(rank, world, case, ep) for case, ep in LAYOUTS[world]}
    results["checkpoint"] = run_checkpoint(rank, world, out_dir)
    if world == test_moe_dispatch.WORLD:
        results["dispatch"] = test_moe_dispatch.run_all(rank)
    if world == test_mx_dispatch.WORLD:
        results["mx_dispatch"] = test_mx_dispatch.run_all(rank)
    if world == test_router.WORLD:
        results["balance"] = test_router.run_balance(rank)
    if world == test_trace.WORLD:
        results["trace"] = test_trace.run_on_rank(rank, out_dir)
    return results


@pytest.fixture(scope="module")
def references() -> dict:
    return {}


def reference_of(references: dict, case: str) -> dict:
    case = SAME_REFERENCE.get(case, case)
    if case not in references:
        references[case] = reference(case)
    return references[case]


def assert_grads_match(per_rank: list[dict], want: dict[str, torch.Tensor], label: str) -> None:
    assert set(per_rank[0]) == set(want), label
    for name, full in want.items():
        rows = full.reshape(full.shape[0], -1) if full.dim() else full.reshape(1, 1)
        for r, grads in enumerate(per_rank):
            info, grad = grads[name]
            assert tuple(info.global_shape) == tuple(full.shape), f"{label} {name}"
            torch.testing.assert_close(grad.reshape(info.length, rows.shape[1]), rows[info.offset:info.offset + info.length],
                                       msg=lambda m, r=r, name=name: f"{label}, rank {r}, {name}: {m}", **TOL)
        assert sum(grads[name][0].length for grads in per_rank) == rows.shape[0], f"{label} {name}: held once"


@pytest.mark.parametrize("world, case, ep", RUNS, ids=[f"{case}-ep{ep}-{world}ranks" for world, case, ep in RUNS])
def test_expert_parallel_matches_one_process(request, references, world, case, ep):
    per_rank = request.getfixturevalue(f"ep_spawn_{world}")  # (tests/conftest.py: one spawn per world size)
    want = reference_of(references, case)
    got = [results[(case, ep)] for results in per_rank]
    label = f"{case}, ep={ep} on {world} ranks"
    torch.testing.assert_close(got[0]["losses"], want["losses"], **TOL, msg=lambda m: f"{label}: {m}")
    assert_grads_match([g["grads"] for g in got], want["grads"], label)


@pytest.mark.parametrize("world", [2, 4])
def test_a_checkpoint_saved_at_ep2_resumes_at_ep4_and_ep1(request, world):
    result = request.getfixturevalue(f"ep_spawn_{world}")[0]["checkpoint"]
    assert sorted(result["resumed"]) == ([1, 4] if world == 4 else [1])
    for ep, losses in result["resumed"].items():
        torch.testing.assert_close(losses, result["uninterrupted"][1:], **TOL, msg=lambda m, ep=ep: f"ep={ep}: {m}")


def test_a_checkpoint_saved_at_ep2_resumes_in_one_process_and_exports_to_hugging_face(ep_spawn_4, tmp_path):
    """Every expert once, with its global shape: one process loads it whole and trains on to
    the uninterrupted losses, and the export is transformers' own model with the same loss."""
    from transformers import Qwen3MoeForCausalLM

    result = ep_spawn_4[0]["checkpoint"]
    model = build("qwen3_moe", ours=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    checkpoint.load(result["path"], model, optimizer)
    with torch.no_grad():
        ids = global_batch(1, model.config.vocab_size)
        loaded_loss = model(input_ids=ids, labels=ids).loss.item()
    losses = []
    for step in range(1, STEPS):
        ids = global_batch(step, model.config.vocab_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    torch.testing.assert_close(losses, result["uninterrupted"][1:], **TOL)
    exported = Qwen3MoeForCausalLM.from_pretrained(export_hf(result["path"], tmp_path / "hf")).eval()
    with torch.no_grad():
        ids = global_batch(1, model.config.vocab_size)
        assert exported(input_ids=ids, labels=ids).loss.item() == pytest.approx(loaded_loss, rel=1e-6)
