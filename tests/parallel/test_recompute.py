"""Activation recompute gives the same gradients as none, and saves activation memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy
from transformers import Qwen3Config, Qwen3ForCausalLM

from hyperparallel.errors import ConfigError
from hyperparallel.lowp.memory import saved_activation_bytes
from hyperparallel.parallel import apply_recompute
from hyperparallel.parallel.recompute import SAVED_OPS, _policy
from tests.train.test_plan import real_step_peak, tiny


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_dropout=0.0,
                      use_cache=True)  # apply_recompute must turn the KV cache off
    return Qwen3ForCausalLM(cfg).train()


def grads_of(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recompute_gives_the_same_loss_and_gradients(mode):
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    plain = tiny_model()
    loss_ref, grads_ref = grads_of(plain, ids)
    model = tiny_model()
    assert apply_recompute(model, mode) == 2
    loss, grads = grads_of(model, ids)
    assert torch.equal(loss, loss_ref)
    for name, grad in grads.items():  # measured: equal bit for bit (on 1 and 2 threads), as the loss
        assert torch.equal(grad, grads_ref[name]), name
    assert list(dict(model.state_dict())) == list(dict(plain.state_dict()))  # names unchanged


def _saved_bytes(model, ids) -> int:
    return saved_activation_bytes(lambda: model(input_ids=ids, labels=ids).loss.backward())


def test_full_recompute_keeps_only_layer_inputs():
    # (selective recompute keeps its matmul outputs in checkpoint's own storage, which saved-tensor
    # hooks do not see; its policy is tested below)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(2))
    sizes = {}
    for mode in ("off", "full"):
        model = tiny_model()
        apply_recompute(model, mode)
        sizes[mode] = _saved_bytes(model, ids)
    assert sizes["full"] < sizes["off"] / 2


def test_selective_and_full_recompute_lower_a_training_steps_measured_peak():
    """The most tensor bytes alive in one steady-state step of the real trainer (the CPU
    allocator's own events: tests/train/test_plan.py's real_step_peak, parameters and optimizer
    state included), the dense tiny Qwen3 at seq_len 256, micro-batch 2, for each mode."""
    peak = {mode: real_step_peak(tiny("qwen3", data={"seq_len": 256}, parallel={"recompute": mode}))
            for mode in ("off", "selective", "full")}
    # measured (the same on 1, 2 and 3 threads): off 12,429,952 bytes, selective 9,263,616 (0.745 of
    # off), full 6,498,292 (0.523 of off, 0.701 of selective); recompute undone, each is off's
    assert peak["selective"] < 0.8 * peak["off"]
    assert peak["full"] < 0.8 * peak["selective"]


def test_selective_policy_keeps_matmuls_and_recomputes_the_rest():
    mm = torch.ops.aten.mm.default
    assert mm in SAVED_OPS and _policy(None, mm) == CheckpointPolicy.MUST_SAVE
    assert _policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE


def test_unknown_mode_and_a_model_without_layers_are_refused():
    with pytest.raises(ConfigError, match="one of off, full, selective, got .half."):
        apply_recompute(tiny_model(), "half")
    with pytest.raises(ConfigError, match="no decoder layers"):
        apply_recompute(torch.nn.Linear(2, 2), "full")


def test_selective_policy_keeps_the_grouped_experts_matmul():
    import hyperparallel.moe  # noqa: F401  (registers hyperparallel::grouped_mm)

    assert _policy(None, torch.ops.hyperparallel.grouped_mm.default) == CheckpointPolicy.MUST_SAVE
