"""Stand-ins unpickle in a fresh process that has imported nothing (models/standins.py pickles a
stand-in as its two classes, each by its own module): a swapped model, a lone swapped module and a
list of them; and a deep copy is the same class again."""

from __future__ import annotations

import copy
import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from hyperparallel.models import build_model, swap_moe_blocks
from hyperparallel.models.standins import stands_in

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def swapped():
    config = yaml.safe_load((ROOT / "configs" / "models" / "qwen3_moe_tiny.yaml").read_text())
    model = build_model("qwen3_moe", config=config, seed=3)
    swap_moe_blocks(model)
    return model


def unpickled(data: bytes) -> list[str]:
    """The class names of the stand-ins in `data` unpickled by a fresh process."""
    code = ("import json, pickle, sys\n"
            "found = pickle.loads(sys.stdin.buffer.read())\n"
            "print(json.dumps(sorted({type(m).__name__ for m in found.modules() if type(m).__name__.endswith("
            "('AsTopKRouter', 'AsGroupedExperts'))})))")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.decode().splitlines()[-1])


def test_a_swapped_model_unpickles_in_a_fresh_process(swapped):
    names = sorted({type(m).__name__ for m in swapped.modules() if stands_in(m)})
    assert names == ["Qwen3MoeExpertsAsGroupedExperts", "Qwen3MoeTopKRouterAsTopKRouter"]
    assert unpickled(pickle.dumps(swapped)) == names


def test_a_lone_stand_in_and_a_list_of_them_unpickle_in_a_fresh_process(swapped):
    router = next(m for m in swapped.modules() if type(m).__name__ == "Qwen3MoeTopKRouterAsTopKRouter")
    experts = next(m for m in swapped.modules() if type(m).__name__ == "Qwen3MoeExpertsAsGroupedExperts")
    assert unpickled(pickle.dumps(router)) == [type(router).__name__]
    assert unpickled(pickle.dumps(nn.ModuleList([router, experts]))) == sorted([type(router).__name__,
                                                                                type(experts).__name__])


def test_a_deep_copy_is_the_same_stand_in_with_equal_weights_and_references_to_itself(swapped):
    experts = next(m for m in swapped.modules() if stands_in(m) and type(m).__name__.endswith("GroupedExperts"))
    experts.myself = [experts]  # a reference back to the module, as a hook's bound method holds
    try:
        copied = copy.deepcopy(experts)
    finally:
        del experts.myself
    assert type(copied) is type(experts) and isinstance(copied, type(experts).stands_in_for)
    assert copied.myself[0] is copied  # (not a second copy, made before the first was in deepcopy's memo)
    for (name, a), (_, b) in zip(experts.state_dict().items(), copied.state_dict().items(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name
