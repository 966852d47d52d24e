"""`hyperparallel plan`'s step time (train/planning/plan_time.py): a compiled graph's element-wise
chains counted as one memory pass each, and the casts FSDP's bf16 gathers leave autocast nothing
to do."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from hyperparallel.train import planning
from hyperparallel.train.config import from_mapping
from hyperparallel.train.planning.device_model import GPUS
from hyperparallel.train.planning.timeline import _Recorder

ROOT = Path(__file__).resolve().parent.parent.parent
KIB4 = 1024 * 4  # one float32 tensor of 1024 elements


def tiny(**sections):
    raw = {
        "model": {"family": "qwen3_moe",
                  "config": yaml.safe_load((ROOT / "configs/models/qwen3_moe_tiny.yaml").read_text())},
        "data": {"max_corpus_bytes": 60_000, "vocab_size": 512, "seq_len": 64},
        "training": {"steps": 4, "global_batch": 4, "micro_batch": 2, "compile": "none"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return from_mapping(raw)


def recorded_chain():
    """x -> mul -> exp -> add -> sigmoid as one compiled graph, then an eager sum reading its result
    and a product reading an intermediate."""
    recorder = _Recorder()
    x, w = torch.randn(1024), torch.randn(1024, 4)
    with recorder:
        recorder.begin_graph()
        y = (x * 2).exp()
        z = (y + 1).sigmoid()
        recorder.end_graph()
        z.sum()
        torch.mm(y.view(1, -1), w)  # (reads y: the chain must write it)
    return recorder.costs


def test_a_compiled_element_wise_chain_is_one_memory_pass():
    eager = recorded_chain()
    fused = eager.fused()
    # eager: four element-wise operators, each reading its input and writing its output, then the
    # sum and the product
    assert len(eager.ops) == 6
    assert [op[1] for op in eager.ops[:4]] == [2 * KIB4] * 4
    # compiled: the chain reads x once and writes y (read by the product) and z (read by the sum)
    # once each; the sum and the product as they were
    assert len(fused.ops) == 3
    assert fused.ops[0] == (0, 3 * KIB4, "float32", False, 0)
    assert fused.ops[1:] == eager.ops[4:]
    h100 = GPUS["h100"]
    # small tensors: each kernel its floor; one for the chain, not four
    assert eager.seconds(h100) - fused.seconds(h100) == pytest.approx(3 * h100.op_floor_s)


def test_element_wise_operators_outside_a_compiled_graph_stay_apart():
    recorder = _Recorder()
    x = torch.randn(1024)
    with recorder:
        y = (x * 2).exp()
        recorder.begin_graph()
        z = (y + 1).sigmoid()
        recorder.end_graph()
        z.sum()
    ops = recorder.costs
    assert [len(ops.ops), len(ops.fused().ops)] == [5, 4]  # (mul and exp eager; add and sigmoid one pass)
    assert ops.fused().ops[2][1] == 2 * KIB4  # (reads y, writes z)


def test_the_backward_of_a_compiled_forward_is_compiled_too():
    """Operators autograd runs for a node the compiled forward made belong to its backward graph."""
    recorder = _Recorder()
    x = torch.randn(1024, requires_grad=True)
    with recorder:
        recorder.begin_graph()
        y = (x * 2).exp().sigmoid()
        recorder.end_graph()
        y.sum().backward()
    graphs = recorder.costs.graphs
    forward, backward = set(graphs[:3]), {g for g in graphs[3:] if g >= 0}
    assert forward == {0} and backward == {1}  # (graph 0's forward, its backward numbered after every forward)
    assert len(recorder.costs.fused().ops) < len(recorder.costs.ops)


def test_compile_shortens_the_predicted_compute_and_leaves_eager_as_it_was():
    options = {"runtime": 0, "device_model": GPUS["h100"]}
    eager = planning.plan(tiny(), 1, **options)
    again = planning.plan(tiny(), 1, **options)
    compiled = planning.plan(tiny(training={"compile": "inductor"}), 1, **options)
    assert eager.time == again.time
    assert compiled.time.compute_s < eager.time.compute_s


def test_bf16_gathers_leave_autocast_no_casts_of_the_products_weights():
    """Sharded under bf16 the products' weights arrive in bf16 (parallel/mixed_precision.py): their
    casts, and their gradients' casts back to float32, are not planned; the norms' are."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from hyperparallel.parallel.mixed_precision import keep_float32_outside_products
    from hyperparallel.train.planning.plan_time import gathered_in_bf16

    cfg = tiny(training={"mixed_precision": "bf16"})
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = planning.fake_model(cfg, mode, torch.device("cpu"))
    costs = planning.simulate(model, mode, cfg, torch.device("cpu")).costs
    keep_float32_outside_products(model)
    names = [name for name, _ in model.named_parameters()]
    products = gathered_in_bf16(model, True)
    assert products and not any("norm" in names[j] for j in products)
    assert gathered_in_bf16(model, False) == frozenset()
    cast = set(costs.param_casts.values())  # (forward: autocast's copy; backward: the gradient's)
    assert cast & products and sorted(costs.param_casts.values()).count(min(cast & products)) >= 2
    fewer = costs.without_casts_of(products)
    assert len(fewer.ops) == len(costs.ops) - sum(j in products for j in costs.param_casts.values())


def test_an_in_place_product_counts_its_flops():
    """torch's FLOP registry has addmm, not addmm_ (the fused loss accumulates its head's gradient
    with it): the in-place product costs what the out-of-place one does."""
    from hyperparallel.train.planning.plan_time import op_cost

    acc, a, b = torch.zeros(64, 32), torch.randn(64, 128), torch.randn(128, 32)
    aten = torch.ops.aten
    out_of_place = op_cost(aten.addmm.default, (acc, a, b), {}, aten.addmm.default(acc, a, b))
    in_place = op_cost(aten.addmm_.default, (acc, a, b), {}, aten.addmm_.default(acc.clone(), a, b))
    assert in_place[0] == out_of_place[0] == 2 * 64 * 128 * 32
