"""Context parallelism on 4 gloo ranks against one process on the same global batch.

The ranks of the shared 4-rank spawn (with tests/dist/test_parallel_layouts.py) run cp=4 on all of them and cp=2 in two subgroups ({0, 1} and {2, 3}, both
on the same batch). The references are one process: torch's SDPA (is_causal) on the whole
sequence for the attention functions alone; for the models, transformers' own model with its
SDPA attention on the whole batch, whose loss and gradients the CP ranks must give (the mean of
the ranks' losses; each gradient summed over the group and divided by cp, what FSDP's mean gives).

fp32. Ulysses runs the same SDPA on the same numbers per head (measured difference 0); ring
attention sums the blocks in another order: its outputs and q/k/v gradients measured at most
4.3e-6 apart by the fused CPU kernel (head dims padded: 4.3e-6; equal: 2.4e-6) and 2.4e-6 by
the hand-written tiles (values of order 1; tolerance 3e-5). The models' losses (about 6.2)
measured at most 9.5e-7 apart (two fp32 ulps; tolerance 1e-5) and their gradients (up to 0.16)
at most 8.2e-8 (tolerance 1e-6), in every mode, cp, model and labelling.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model
from hyperparallel.parallel import context_attention
from hyperparallel.parallel.context_attention import ring_attention, ulysses_attention
from hyperparallel.parallel.context_parallel import (
    _no_mask,
    apply_context_parallel,
    context_parallel_batch,
    gather_sequence,
    load_balanced_positions,
    shard_sequence,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
WORLD = 4
CPS = (2, 4)
MODES = ("ulysses", "ring")
ROWS, SEQ = 2, 32  # SEQ divides by 2 * cp for every cp here
MODELS = {"qwen3": "qwen3_tiny.yaml", "kimi_k2": "kimi_k2_tiny.yaml"}  # kimi_k2: MLA, qk 24 / v 16, 4 heads
LABELS = ("padded", "packed")
SCALE = 0.3
# ulysses measured 0 (the same SDPA per head); its tolerance admits a few fp32 ulps of values of
# order 1 should a kernel split its work otherwise
ATTENTION_TOL = {"ring": {"rtol": 0, "atol": 3e-5}, "ulysses": {"rtol": 0, "atol": 1e-6}}
LOSS_TOL = {"rtol": 0, "atol": 1e-5}
GRAD_TOL = {"rtol": 0, "atol": 1e-6}
# bf16 ring attention: float32 inside, rounded once to bf16 on the way out (half an ulp, 2^-9)
BF16_TOL = {"rtol": 2.0 ** -8, "atol": 1e-5}


def config(family: str, **overrides) -> dict:
    values = yaml.safe_load((CONFIGS / MODELS[family]).read_text())
    values.update(overrides)
    return values


def attention_inputs(dtype=torch.float32, value_dim: int = 16) -> dict[str, torch.Tensor]:
    """GQA (4 query heads on 2 key/value heads) with a value head dim (16) unlike the query's (24)
    unless `value_dim` says otherwise; `weight` makes the loss sum(out * weight), so every output
    element has its own gradient."""
    g = torch.Generator().manual_seed(1)
    shapes = {"query": (ROWS, 4, SEQ, 24), "key": (ROWS, 2, SEQ, 24), "value": (ROWS, 2, SEQ, value_dim),
              "weight": (ROWS, 4, SEQ, value_dim)}
    return {name: torch.randn(shape, generator=g).to(dtype) for name, shape in shapes.items()}


def reference_attention(dtype=torch.float32, compute=torch.float32, value_dim: int = 16) -> dict[str, torch.Tensor]:
    """SDPA on the whole sequence, on the inputs made in `dtype` and computed in `compute`."""
    inputs = {name: x.to(compute) for name, x in attention_inputs(dtype, value_dim).items()}
    q, k, v = (inputs[name].clone().requires_grad_() for name in ("query", "key", "value"))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=SCALE, enable_gqa=True)
    (out.float() * inputs["weight"].float()).sum().backward()
    return {"out": out.detach(), "query": q.grad, "key": k.grad, "value": v.grad}


def run_attention(mode: str, group, dtype=torch.float32, value_dim: int = 16) -> dict[str, torch.Tensor]:
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    local = {name: shard_sequence(x, cp, rank, dim=2) for name, x in attention_inputs(dtype, value_dim).items()}
    q, k, v = (local[name].clone().requires_grad_() for name in ("query", "key", "value"))
    kernel = ring_attention if mode == "ring" else ulysses_attention
    out = kernel(q, k, v, group, SCALE)
    (out.float() * local["weight"].float()).sum().backward()
    return {"out": out.detach(), "query": q.grad, "key": k.grad, "value": v.grad}


def model_batch(vocab: int, labels: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`padded`: row 0 has a 4-token prompt and 12 pad tokens (-100), row 1 three pads, so the
    ranks count different numbers of tokens; `packed`: every token counted."""
    ids = torch.randint(0, vocab, (ROWS, SEQ), generator=torch.Generator().manual_seed(7))
    targets = ids.clone()
    if labels == "padded":
        targets[0, :4] = -100
        targets[0, 20:] = -100
        targets[1, 29:] = -100
        ids[0, 20:] = 0
        ids[1, 29:] = 0
    return ids, targets


def reference_model(family: str, labels: str) -> dict:
    model = build_model(family, config=config(family), seed=0)
    ids, targets = model_batch(model.config.vocab_size, labels)
    loss = model(input_ids=ids, labels=targets).loss
    loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None}}


def run_model(model, mode: str, group, labels: str) -> dict | None:
    """One forward / backward of the CP ranks; the group's mean loss and gradients (on its rank 0)."""
    cp = apply_context_parallel(model, group, mode)
    model.zero_grad(set_to_none=True)
    ids, targets = model_batch(model.config.vocab_size, labels)
    local_ids, shift_labels, position_ids, count = context_parallel_batch(ids, targets, cp.size, cp.rank)
    loss = model(input_ids=local_ids, position_ids=position_ids, labels=shift_labels, shift_labels=shift_labels,
                 num_items_in_batch=count).loss
    loss.backward()
    names = [n for n, p in model.named_parameters() if p.grad is not None]
    flat = torch.cat([loss.detach().reshape(1)] + [model.get_parameter(n).grad.reshape(-1) for n in names])
    dist.all_reduce(flat, group=group)
    flat /= cp.size
    if cp.rank:
        return None
    grads, offset = {}, 1
    for n in names:
        p = model.get_parameter(n)
        grads[n] = flat[offset:offset + p.numel()].view(p.shape).clone()
        offset += p.numel()
    return {"loss": flat[0].item(), "grads": grads}


def error_message(call) -> str:
    try:
        call()
    except ConfigError as error:
        return str(error)
    return "no ConfigError"


def config_errors(groups: dict) -> dict[str, str]:
    """The errors that need a group of 4 ranks."""
    q = torch.zeros(1, 6, 8, 16)
    six_heads = build_model("qwen3", config=config("qwen3", num_attention_heads=6), seed=0)
    odd = torch.zeros(1, 4, 7, 16)  # 7 local tokens: a sequence of 28 on 4 ranks

    def without_positions():
        apply_context_parallel(six_heads, groups[4], "ring")  # ring takes any number of heads
        ids = shard_sequence(model_batch(six_heads.config.vocab_size, "packed")[0], 4, dist.get_rank())
        six_heads(input_ids=ids)  # transformers then makes positions 0..7, not this rank's

    return {"positions": error_message(without_positions),
            "ulysses_heads": error_message(lambda: ulysses_attention(q, q[:, :2], q[:, :2], groups[4])),
            "ulysses_model_heads": error_message(lambda: apply_context_parallel(six_heads, groups[4], "ulysses")),
            "ring_sequence": error_message(lambda: ring_attention(odd, odd, odd, groups[4]))}


def run_on_rank(rank: int, world: int) -> dict:
    """Every case of this file on one rank of the shared 4-rank spawn (tests/conftest.py's
    `parallel_spawn_4`, tests/dist/test_parallel_layouts.py's on_ranks): the ranks start once."""
    assert world == WORLD
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    groups = {4: dist.group.WORLD, 2: pairs[rank // 2]}
    start = time.perf_counter()
    results: dict = {"attention": {}, "equal_dims": {}, "repeated_heads": {}, "tiles": {}, "models": {}}
    # ring on CPU: the fused kernel (its head dims padded to one here, equal in "equal_dims")
    for cp in CPS:
        for mode in MODES:
            results["attention"][(mode, cp)] = run_attention(mode, groups[cp])
        results["equal_dims"][cp] = run_attention("ring", groups[cp], value_dim=24)
    # the fused kernel with the key/value heads repeated to the query's (torch without its GQA)
    native_gqa, context_attention._NATIVE_GQA = context_attention._NATIVE_GQA, False
    for cp in CPS:
        results["repeated_heads"][cp] = run_attention("ring", groups[cp])
    context_attention._NATIVE_GQA = native_gqa
    results["bf16"] = {"fused": run_attention("ring", groups[2], torch.bfloat16)}
    # the hand-written tiles (other devices' path), in their own size and one query row a tile
    context_attention._FUSED_CPU = False
    results["bf16"]["tiles"] = run_attention("ring", groups[2], torch.bfloat16)
    for cp in CPS:
        results["tiles"][cp] = run_attention("ring", groups[cp])
    tile = context_attention._TILE_SCORES
    context_attention._TILE_SCORES = ROWS * 4 * SEQ // 2  # one query row a tile at cp=2 (batch x heads x 16 keys)
    results["tiled"] = run_attention("ring", groups[2])
    context_attention._TILE_SCORES, context_attention._FUSED_CPU = tile, True
    results["attention_seconds"] = time.perf_counter() - start
    for family in MODELS:
        model = build_model(family, config=config(family), seed=0)
        for cp in CPS:
            for mode in MODES:
                for labels in LABELS:
                    results["models"][(family, mode, cp, labels)] = run_model(model, mode, groups[cp], labels)
    results["errors"] = config_errors(groups)
    results["seconds"] = time.perf_counter() - start
    return results


@pytest.fixture(scope="module")
def ranks(parallel_spawn_4) -> list[dict]:
    return [r["context_parallel"] for r in parallel_spawn_4["per_rank"]]


def group_of(rank: int, cp: int) -> tuple[int, int]:
    """(the rank's place in its cp group, the group's first rank)."""
    return rank % cp, rank - rank % cp


def max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("mode", MODES)
def test_attention_matches_sdpa_on_the_whole_sequence(ranks, mode, cp):
    want = reference_attention()
    worst = 0.0
    for rank, results in enumerate(ranks):
        got, (place, _) = results["attention"][(mode, cp)], group_of(rank, cp)
        for name, full in want.items():
            local = shard_sequence(full, cp, place, dim=2)
            worst = max(worst, max_difference(got[name], local))
            torch.testing.assert_close(got[name], local, **ATTENTION_TOL[mode],
                                       msg=lambda m, name=name, rank=rank: f"{mode} cp={cp} rank {rank} {name}: {m}")
    print(f"\n{mode} cp={cp}: output and q/k/v gradients at most {worst:.2e} from SDPA")


@pytest.mark.parametrize("case", [(variant, cp) for variant in ("equal_dims", "repeated_heads", "tiles") for cp in CPS]
                         + [("tiled", 2)], ids=lambda case: f"{case[0]}-cp{case[1]}")
def test_ring_attention_variants_match_sdpa(ranks, case):
    """The fused kernel with equal head dims (no padding) and with the key/value heads repeated;
    the hand-written tiles, in their own size and in one-row tiles (\"tiled\", cp=2)."""
    variant, cp = case
    want = reference_attention(value_dim=24 if variant == "equal_dims" else 16)
    worst = 0.0
    for rank, results in enumerate(ranks):
        got = results[variant] if variant == "tiled" else results[variant][cp]
        place = group_of(rank, cp)[0]
        for name, full in want.items():
            local = shard_sequence(full, cp, place, dim=2)
            worst = max(worst, max_difference(got[name], local))
            torch.testing.assert_close(got[name], local, **ATTENTION_TOL["ring"],
                                       msg=lambda m, name=name, rank=rank: f"{variant} rank {rank} {name}: {m}")
    print(f"\nring {variant} cp={cp}: output and q/k/v gradients at most {worst:.2e} from SDPA")


@pytest.mark.parametrize("path", ["fused", "tiles"])
def test_ring_attention_in_bf16(ranks, path):
    """The output is the float32 result rounded once; the gradients come, as flash attention's,
    from the bf16 output (rowsum(dO * O)), so they are held to flash attention's own test: at most
    twice the error of torch's SDPA run in bf16, both against SDPA in float32 on the same inputs."""
    exact = reference_attention(torch.bfloat16)
    torch_bf16 = reference_attention(torch.bfloat16, torch.bfloat16)
    for name, full in exact.items():
        bound = 2 * max_difference(torch_bf16[name], full)
        worst = 0.0
        for rank, results in enumerate(ranks):
            got = results["bf16"][path][name]
            assert got.dtype == torch.bfloat16, name
            local = shard_sequence(full, 2, group_of(rank, 2)[0], dim=2)
            worst = max(worst, max_difference(got, local))
            if name == "out":
                torch.testing.assert_close(got.float(), local, **BF16_TOL, msg=lambda m, rank=rank: f"rank {rank}: {m}")
        print(f"\nring bf16 {path} {name}: at most {worst:.2e} from float32 SDPA (SDPA in bf16: {bound / 2:.2e})")
        assert worst <= bound, f"{name}: {worst:.3e} > 2 x torch's bf16 SDPA error {bound / 2:.3e}"


@pytest.fixture(scope="module")
def references() -> dict:
    return {(family, labels): reference_model(family, labels) for family in MODELS for labels in LABELS}


@pytest.mark.parametrize("labels", LABELS)
@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", list(MODELS))
def test_model_loss_and_gradients_match_one_process(ranks, references, family, mode, cp, labels):
    want = references[(family, labels)]
    for leader in range(0, WORLD, cp):  # each group's rank 0 holds the group's mean
        got = ranks[leader]["models"][(family, mode, cp, labels)]
        label = f"{family} {mode} cp={cp} {labels} (group of rank {leader})"
        assert set(got["grads"]) == set(want["grads"]), label
        loss_difference = abs(got["loss"] - want["loss"])
        grad_difference = max(max_difference(got["grads"][n], g) for n, g in want["grads"].items())
        print(f"\n{label}: loss {want['loss']:.6f}, |d loss| {loss_difference:.1e}, max |d grad| {grad_difference:.1e}")
        torch.testing.assert_close(got["loss"], want["loss"], **LOSS_TOL, msg=lambda m, label=label: f"{label}: {m}")
        for name, grad in want["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, **GRAD_TOL,
                                       msg=lambda m, name=name, label=label: f"{label} {name}: {m}")


def test_config_errors_that_need_a_group(ranks):
    errors = ranks[0]["errors"]
    assert "6 query heads" in errors["ulysses_heads"] and "cp=4" in errors["ulysses_heads"], errors
    assert "6 query heads" in errors["ulysses_model_heads"] and "cp=4" in errors["ulysses_model_heads"], errors
    assert "28" in errors["ring_sequence"] and "cp=4" in errors["ring_sequence"], errors
    assert "position_ids" in errors["positions"], errors


# ---------------------------------------------------------------------------------------------
# one process


def test_the_layout_is_load_balanced_and_gathers_back():
    assert load_balanced_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert load_balanced_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    x = torch.arange(2 * 24).reshape(2, 24)
    parts = [shard_sequence(x, 3, r) for r in range(3)]
    assert torch.equal(gather_sequence(parts), x)
    # the causal work per rank: the same number of (query, key) pairs under the mask
    work = [int((load_balanced_positions(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1, work


def test_the_batch_shifts_on_the_whole_sequence_and_counts_the_whole_batch():
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[1, 5:] = -100
    local_ids, shift_labels, positions, count = context_parallel_batch(ids, labels, 2, 1)
    assert local_ids.tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert shift_labels.tolist() == [[3, 4, 5, 6], [11, 12, -100, -100]]  # row 1: tokens 5.. are not counted
    assert positions.tolist() == [[2, 3, 4, 5]] * 2
    assert count.dtype == torch.float32 and count.item() == (7 + 4) / 2


def test_config_errors():
    message = error_message(lambda: load_balanced_positions(30, 4, 0))
    assert "30" in message and "cp=4" in message, message
    message = error_message(lambda: context_parallel_batch(torch.zeros(1, 30, dtype=torch.long),
                                                           torch.zeros(1, 30, dtype=torch.long), 4, 0))
    assert "30" in message and "cp=4" in message, message
    assert "not one of" in error_message(lambda: apply_context_parallel(torch.nn.Linear(2, 2), None, "zigzag"))
    assert "AttentionInterface" in error_message(lambda: apply_context_parallel(torch.nn.Linear(2, 2), None, "ring"))
    dropout = build_model("qwen3", config=config("qwen3", attention_dropout=0.1), seed=0)
    assert "attention_dropout" in error_message(lambda: apply_context_parallel(dropout, None, "ring"))
    assert "attention_mask" in error_message(lambda: _no_mask(attention_mask=torch.tensor([[True, False]])))
    assert _no_mask(attention_mask=torch.ones(1, 2, dtype=torch.bool)) is None
