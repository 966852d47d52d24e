"""Stand-ins unpickle in a fresh process (models/standins.py's __getattr__): a swapped model finds
the classes its modules stand in for in its own modeling module, which the model's class imports
first; a lone swapped module finds them among the classes models.families registers."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hyperparallel.models import build_model, swap_moe_blocks
from hyperparallel.models.standins import stands_in

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def swapped():
    config = yaml.safe_load((ROOT / "configs" / "models" / "qwen3_moe_tiny.yaml").read_text())
    model = build_model("qwen3_moe", config=config, seed=3)
    swap_moe_blocks(model)
    return model


def unpickled(data: bytes, first: str = "") -> list[str]:
    """The class names of the stand-ins in `data` unpickled by a fresh process (after `first`)."""
    code = (f"{first}\nimport json, pickle, sys\nfrom hyperparallel.models.standins import stands_in\n"
            "found = pickle.loads(sys.stdin.buffer.read())\n"
            "print(json.dumps(sorted({type(m).__name__ for m in found.modules() if stands_in(m)})))")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.decode().splitlines()[-1])


def test_a_swapped_model_unpickles_in_a_fresh_process(swapped):
    names = sorted({type(m).__name__ for m in swapped.modules() if stands_in(m)})
    assert names == ["Qwen3MoeExpertsAsGroupedExperts", "Qwen3MoeTopKRouterAsTopKRouter"]
    assert unpickled(pickle.dumps(swapped)) == names


def test_a_lone_stand_in_unpickles_where_the_families_are_registered(swapped):
    router = next(m for m in swapped.modules() if type(m).__name__ == "Qwen3MoeTopKRouterAsTopKRouter")
    assert unpickled(pickle.dumps(router), "import hyperparallel.models.families") == [type(router).__name__]
