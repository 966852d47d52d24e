"""DeepSeek-V4 in the trainer: MegaGate and MegaMHC on train as transformers' modules do.

Both runs start from the same seed and read the same batches; with the kernels off the routers
run op by op as transformers' do and the hyper-connections are transformers' own modules. fp32.

AdamW's eps is 1e-5 here, not 1e-8: a gradient element that is rounding noise around zero (the
hyper-connections' base and scale gradients are sums that nearly cancel) would otherwise move
its weight by +-lr at once, and the two runs then part by Adam's doing, not the kernels' (with
1e-8 the losses measured up to 5e-4 apart by step 18; with 1e-5, at most 1.1e-6 or, on another
machine, one step 1.03e-5: the first test).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hyperparallel.train.loop import train
from tests.train.test_cli_train import losses as logged_losses
from tests.train.test_loop import config

STEPS = 20


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))


def losses(tmp_path, name: str, *, kernels: bool, steps: int = STEPS, **sections) -> list[float]:
    summary = train(config(tmp_path / name, "deepseek_v4", training={"steps": steps},
                           optimizer={"lr": 3e-3, "eps": 1e-5}, kernels={"mega_gate": kernels, "mega_mhc": kernels},
                           **sections))
    return [r["loss"] for r in summary["records"] if "loss" in r]


def test_deepseek_v4_trains_with_mega_gate_and_mega_mhc_as_without(tmp_path, capsys):
    on = losses(tmp_path, "on", kernels=True)
    log_on = capsys.readouterr().out
    off = losses(tmp_path, "off", kernels=False)
    assert len(on) == STEPS and on[-1] < on[0] - 0.5  # it learns
    # relative differences measured: on a 2-core AVX-512 machine at most 7.5e-7 on 1 thread (step
    # 16), 1.1e-6 on 2 and 4 (step 15); on another AVX-512 machine every step within 3.4e-7 but step
    # 16, 1.03e-5 apart (a near-tie of router scores the two rounding orders break differently, for
    # that step only). So: every step within 1e-5 but one at most, that one within 1e-4.
    apart = [abs(a - b) / b for a, b in zip(on, off, strict=True)]
    assert sum(d > 1e-5 for d in apart) <= 1 and max(apart) < 1e-4, apart
    assert "kernels: MegaGate on (4 routers), MegaMHC on (4 hyper-connected layers)" in log_on
    assert "kernels: MegaGate off, MegaMHC off" in capsys.readouterr().out


def test_deepseek_v4_trains_in_mxfp8_with_the_kernels_as_without(tmp_path):
    """MXFP8 rounds to 3 mantissa bits: inputs 1e-7 apart (the kernels' fp32 rounding) put an
    element of some block on the other side of a rounding boundary, and the runs part from the
    second step on. Measured over 20 steps (an earlier build, another machine): the first step
    1.8e-6 relative apart, steps 2-6 up to 6.8e-4, later ones up to 1.1e-2. Six steps here (20
    cost the suite half a minute)."""
    mx = {"low_precision": {"enabled": True}}
    on = losses(tmp_path, "on", kernels=True, steps=6, **mx)
    off = losses(tmp_path, "off", kernels=False, steps=6, **mx)
    # measured on a 2-core AVX-512 machine, 1 thread (2 threads): the first 4 steps equal, then
    # 1.8e-5 and 5.6e-5 (3.5e-5) apart. Steps 2-6 within 2e-3: 36x that (3x the earlier 6.8e-4);
    # the gradient through each MegaMHC layer's output cut to 0.2 parts them by up to 6.1e-3 (which
    # 1e-2 let through). An error in the forward shows in the first step: the routing weights 0.1%
    # too large part it by 3.3e-5.
    assert on[0] == pytest.approx(off[0], rel=2e-5)
    assert on[1:] == pytest.approx(off[1:], rel=2e-3)


# The steps of the EP run that stay within fp32 rounding of each other. The kernels round in
# another order (1e-7 apart): once a token's router scores for two experts are that close, the
# runs route it differently and part. Measured with the per-module seeded init: steps 1-13 equal
# to 1e-5 (most exactly), then up to 2.2e-4 apart over steps 14-20. (With the init of
# one global RNG stream before it, all 20 steps stayed within 1e-5; configs/deepseek_v4.yaml's
# model at the same layout stays within 1e-7 for 20 steps.)
EP_STEPS_EQUAL = 13


def test_deepseek_v4_with_ep2_and_megamoe_trains_with_the_kernels_as_without(spawn_2):
    """dp_shard 2, ep 2, MegaMoE in 2 waves, 20 steps (run by the ranks of the shared 2-rank spawn,
    tests/train/test_cli_train.py's trainer_runs)."""
    runs = spawn_2["trainer"][0]
    on, off = (logged_losses(Path(runs[f"deepseek_v4_kernels_{how}"])) for how in ("on", "off"))
    assert len(on) == STEPS and on[-1] < on[0] - 0.3  # it learns
    first, rest = slice(0, EP_STEPS_EQUAL), slice(EP_STEPS_EQUAL, None)
    assert on[first] == pytest.approx(off[first], rel=1e-5)
    assert on[rest] == pytest.approx(off[rest], rel=5e-3), max(abs(a - b) / b for a, b in zip(on, off, strict=True))
