"""Muon against torch.optim.Muon and torch.optim.AdamW, bit for bit; state, schedulers, errors."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from torch.optim.lr_scheduler import LambdaLR

from hyperparallel.errors import ConfigError, ShapeError
from hyperparallel.optim import Muon, orthogonalize

SHAPES = [(32, 16), (16, 32), (16, 16), (1, 40)]  # tall, wide, square, a single row
ADJUST_LR_FNS = [None, "original", "match_rms_adamw"]


def _params(shapes, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=g).to(dtype)) for shape in shapes]


def _clone(params):
    return [nn.Parameter(p.detach().clone()) for p in params]


def _train(optimizers, param_lists, steps, seed=1):
    """Give every param list the same gradients, step every optimizer, ``steps`` times."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        grads = [torch.randn(p.shape, generator=g).to(p.dtype) for p in param_lists[0]]
        for params in param_lists:
            for p, grad in zip(params, grads, strict=True):
                p.grad = grad.clone()
        for optimizer in optimizers:
            optimizer.step()


def _assert_all_equal(xs, ys):
    for x, y in zip(xs, ys, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("nesterov, weight_decay", [(True, 0.1), (False, 0.0)])
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
def test_muon_matches_torch_muon_bit_for_bit(shape, nesterov, weight_decay, adjust_lr_fn):
    ours = _params([shape])
    theirs = _clone(ours)
    kwargs = dict(lr=0.02, weight_decay=weight_decay, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    _train([Muon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)], [ours, theirs], steps=3)
    _assert_all_equal(ours, theirs)


def test_muon_defaults_match_torch_muon():
    ours = _params([(16, 8), (8, 16)])
    theirs = _clone(ours)
    optimizer, reference = Muon(ours), torch.optim.Muon(theirs)
    expected = {key: value for key, value in reference.param_groups[0].items() if key != "params"}
    assert {key: optimizer.param_groups[0][key] for key in expected} == expected
    _train([optimizer, reference], [ours, theirs], steps=2)
    _assert_all_equal(ours, theirs)


@pytest.mark.parametrize("stack_shape", [(3, 16, 8), (3, 8, 16), (2, 12, 12)])
@pytest.mark.parametrize("adjust_lr_fn", ADJUST_LR_FNS)
def test_3d_param_is_a_stack_of_independent_matrices(stack_shape, adjust_lr_fn):
    (stack,) = _params([stack_shape])
    slices = [nn.Parameter(stack.detach()[e].clone()) for e in range(stack_shape[0])]
    kwargs = dict(lr=0.02, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    ours, theirs = Muon([stack], **kwargs), torch.optim.Muon(slices, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        stack.grad = torch.randn(stack_shape, generator=g)
        for e, p in enumerate(slices):
            p.grad = stack.grad[e].clone()
        ours.step()
        theirs.step()
    _assert_all_equal(list(stack.detach()), [p.detach() for p in slices])
    _assert_all_equal(list(ours.state[stack]["momentum_buffer"]), [theirs.state[p]["momentum_buffer"] for p in slices])


def test_orthogonalize_stack_equals_each_slice():
    x = torch.randn(4, 20, 12, generator=torch.Generator().manual_seed(0))
    stacked = orthogonalize(x, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert stacked.dtype == torch.bfloat16 and stacked.shape == x.shape
    _assert_all_equal(list(stacked), [orthogonalize(m, (3.4445, -4.7750, 2.0315), 5, 1e-7) for m in x])


def test_orthogonalize_leaves_a_bf16_input_untouched():
    # torch.optim.Muon (2.13) normalizes a bf16 input in place, which corrupts the momentum buffer
    # when nesterov=False; ours must not.
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    before = x.clone()
    orthogonalize(x)
    assert torch.equal(x, before)


def test_bf16_params_match_torch_muon_with_nesterov():
    ours = _params([(16, 32), (32, 16)], dtype=torch.bfloat16)
    theirs = _clone(ours)
    _train([Muon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)], [ours, theirs], steps=3)
    _assert_all_equal(ours, theirs)


def test_zero_gradient_gives_zero_update():
    (p,) = _params([(8, 4)])
    before = p.detach().clone()
    p.grad = torch.zeros_like(p)
    Muon([p], lr=0.1, weight_decay=0.0).step()
    assert torch.equal(p, before)


@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
def test_adamw_groups_match_torch_adamw_bit_for_bit(weight_decay):
    ours = _params([(5,), (4, 6), (2, 3, 4), ()])
    theirs = _clone(ours)
    group = {
        "params": ours,
        "use_muon": False,
        "lr": 3e-3,
        "betas": (0.8, 0.95),
        "eps": 1e-6,
        "weight_decay": weight_decay,
    }
    reference = torch.optim.AdamW(
        theirs, lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay, foreach=False
    )
    optimizer = Muon([group])
    _train([optimizer, reference], [ours, theirs], steps=4)
    _assert_all_equal(ours, theirs)
    for p, q in zip(ours, theirs, strict=True):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.state[p][key], reference.state[q][key])
            assert optimizer.state[p][key].dtype == reference.state[q][key].dtype


def test_one_optimizer_equals_torch_muon_plus_torch_adamw():
    matrices, vectors = _params([(16, 8), (8, 16)]), _params([(8,), (16,)], seed=2)
    ref_matrices, ref_vectors = _clone(matrices), _clone(vectors)
    optimizer = Muon(
        [{"params": matrices}, {"params": vectors, "use_muon": False, "weight_decay": 0.01}],
        lr=0.02,
        weight_decay=0.1,
        adamw_betas=(0.9, 0.95),
    )
    references = [
        torch.optim.Muon(ref_matrices, lr=0.02, weight_decay=0.1),
        torch.optim.AdamW(ref_vectors, lr=0.02, betas=(0.9, 0.95), weight_decay=0.01, foreach=False),
    ]
    _train([optimizer], [matrices + vectors], steps=3)
    _train(references, [ref_matrices + ref_vectors], steps=3)
    _assert_all_equal(matrices + vectors, ref_matrices + ref_vectors)


def test_group_defaults_depend_on_the_kind():
    matrix, vector = _params([(4, 4), (4,)])
    optimizer = Muon([{"params": [matrix]}, {"params": [vector], "use_muon": False}], lr=0.5, eps=1e-5, adamw_eps=1e-9)
    muon_group, adamw_group = optimizer.param_groups
    assert muon_group["use_muon"] is True and muon_group["eps"] == 1e-5 and muon_group["momentum"] == 0.95
    assert adamw_group["eps"] == 1e-9 and adamw_group["betas"] == (0.9, 0.999) and adamw_group["lr"] == 0.5
    assert "momentum" not in adamw_group and "betas" not in muon_group


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.matrix = nn.Parameter(torch.randn(12, 8, generator=g))
        self.experts = nn.Parameter(torch.randn(3, 8, 12, generator=g))
        self.bias = nn.Parameter(torch.randn(8, generator=g))

    def groups(self):
        return [
            {"params": [self.matrix, self.experts], "name": "muon"},
            {"params": [self.bias], "use_muon": False, "name": "adamw"},
        ]


def test_state_dict_round_trip_continues_identically():
    model = _Mixed()
    optimizer = Muon(model.groups(), lr=0.01)
    _train([optimizer], [list(model.parameters())], steps=2)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)  # through bytes: the state must be plain tensors
    buffer.seek(0)
    restored_model = copy.deepcopy(model)
    restored = Muon(restored_model.groups(), lr=0.01)
    restored.load_state_dict(torch.load(buffer, weights_only=True))
    _train([optimizer], [list(model.parameters())], steps=2, seed=5)
    _train([restored], [list(restored_model.parameters())], steps=2, seed=5)
    _assert_all_equal(model.parameters(), restored_model.parameters())


def test_distributed_checkpoint_state_dict_round_trip():
    model = _Mixed()
    optimizer = Muon(model.groups(), lr=0.01)
    _train([optimizer], [list(model.parameters())], steps=2)
    saved = copy.deepcopy(get_optimizer_state_dict(model, optimizer))  # a copy, as if read from disk
    assert set(saved["state"]) == {"matrix", "experts", "bias"}
    restored_model = copy.deepcopy(model)
    restored = Muon(restored_model.groups(), lr=0.01)
    set_optimizer_state_dict(restored_model, restored, saved)
    _train([optimizer], [list(model.parameters())], steps=2, seed=5)
    _train([restored], [list(restored_model.parameters())], steps=2, seed=5)
    _assert_all_equal(model.parameters(), restored_model.parameters())


def test_lambda_lr_scales_every_group():
    model = _Mixed()
    groups = model.groups()
    groups[1]["lr"] = 0.003
    optimizer = Muon(groups, lr=0.02)
    scheduler = LambdaLR(optimizer, lambda step: 0.5**step)
    for step in range(3):
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([0.02 * 0.5**step, 0.003 * 0.5**step])
        _train([optimizer], [list(model.parameters())], steps=1, seed=step)
        scheduler.step()


def test_zero_lr_from_a_scheduler_freezes_the_params():
    model = _Mixed()
    optimizer = Muon(model.groups(), lr=0.02, weight_decay=0.1)
    LambdaLR(optimizer, lambda step: 0.0)
    before = [p.detach().clone() for p in model.parameters()]
    _train([optimizer], [list(model.parameters())], steps=2)
    _assert_all_equal(model.parameters(), before)


def test_optimizer_survives_deepcopy():
    model = _Mixed()
    clone = copy.deepcopy(Muon(model.groups()[:1], lr=0.01))
    clone.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "use_muon": False})
    assert clone.param_groups[1]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"lr": -1.0}, "lr"),
        ({"lr": float("nan")}, "lr"),
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"momentum": 1.0}, "momentum"),
        ({"momentum": -0.1}, "momentum"),
        ({"nesterov": "yes"}, "nesterov"),
        ({"ns_steps": 0}, "ns_steps"),
        ({"ns_steps": 100}, "ns_steps"),
        ({"ns_coefficients": (1.0, 2.0)}, "ns_coefficients"),
        ({"eps": 0.0}, "eps"),
        ({"adjust_lr_fn": "spectral"}, "adjust_lr_fn"),
    ],
)
def test_bad_muon_hyper_parameters_raise_config_error(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        Muon(_params([(4, 4)]), **kwargs)


@pytest.mark.parametrize(
    "group, key",
    [
        ({"betas": (0.9, 1.0)}, "betas"),
        ({"betas": (0.9,)}, "betas"),
        ({"eps": -1e-8}, "eps"),
        ({"lr": -0.1}, "lr"),
        ({"use_muon": "no"}, "use_muon"),
    ],
)
def test_bad_adamw_group_raises_config_error(group, key):
    with pytest.raises(ConfigError, match=key):
        Muon([{"params": _params([(4,)]), "use_muon": False, **group}])


@pytest.mark.parametrize("shape", [(8,), (), (2, 3, 4, 5)])
def test_muon_group_rejects_params_that_are_not_matrices(shape):
    with pytest.raises(ConfigError, match="use_muon=False"):
        Muon(_params([shape]))


def test_failed_add_param_group_leaves_the_optimizer_unchanged():
    optimizer = Muon(_params([(4, 4)]))
    with pytest.raises(ConfigError):
        optimizer.add_param_group({"params": _params([(4,)], seed=1)})
    assert len(optimizer.param_groups) == 1


def test_complex_params_are_rejected():
    with pytest.raises(ShapeError, match="complex"):
        Muon([nn.Parameter(torch.zeros(4, 4, dtype=torch.complex64))])


@pytest.mark.parametrize("use_muon", [True, False])
def test_sparse_gradients_are_rejected(use_muon):
    (p,) = _params([(4, 4)])
    p.grad = torch.eye(4).to_sparse()
    with pytest.raises(ShapeError, match="sparse"):
        Muon([{"params": [p], "use_muon": use_muon}]).step()


def test_orthogonalize_rejects_vectors():
    with pytest.raises(ShapeError, match="shape"):
        orthogonalize(torch.zeros(8))
