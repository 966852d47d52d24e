"""Conformance with transformers: what transformers' own model tests check, run side by side on
transformers' MoE blocks and on ours (`swap_moe_blocks`), for every MoE family the trainer
supports: Qwen3-MoE, DeepSeek-V3, Kimi K2 (DeepSeek-V3's classes with yarn rope) and DeepSeek-V4.

Each family's tiny model (configs/models/*_tiny.yaml) is built once with transformers' blocks;
"ours" is a `copy.deepcopy` of it with the blocks swapped, so both hold the same weights. The
reference runs transformers' eager experts loop; ours runs GroupedExperts (the swapped model's
experts implementation, "hyperparallel", registered in transformers' experts interface). Each test
works on copies of the pair.

The transformers behaviours covered:
- fp32 forward: logits and every hidden state (`output_hidden_states=True`).
- router logits recorded by transformers' output recorder (`output_router_logits=True`, as a
  forward argument and as the config flag): the same count, shapes, dtypes and values as
  transformers', and the same auxiliary loss (`load_balancing_loss_func`: Qwen3-MoE, DeepSeek-V4;
  DeepSeek-V3 records logits but computes none) and total loss; with a padded attention mask; with
  MegaGate's fused routing. DeepSeek-V4's hash-routed layers are not recorded by transformers and
  not by ours.
- `set_experts_implementation`: "eager", "batched_mm" and "grouped_mm" run transformers' own
  functions (called through its experts interface, as transformers' tests check with mocks) on our
  Parameters and give transformers' outputs; "hyperparallel" runs ours again; another
  implementation transformers accepts ("deepgemm", "sonicmoe") runs transformers' own (the same
  outcome as transformers' model: on the CPU, its own error); one that would drop our MXFP8 recipe
  or expert parallelism is refused with a ConfigError naming what ours run, never silently ignored.
- save_pretrained, then loading (build_model(path=...), which swaps): the same state dict and logits.
- transformers' init paths reach our modules: `init_weights()` gives our router and expert weights
  normal(0, initializer_range) and a zero correction bias; a seed gives the same state dict with
  and without the swap; keys missing from a checkpoint (`from_pretrained`) are initialized, the
  loaded ones keep their values.
- `generate` (greedy) with and without the KV cache: transformers' tokens.
- gradient checkpointing: the same gradients as without it and as transformers'.
- `.to(torch.bfloat16)`: runs, finite, close to transformers' model in bf16.

Tolerances, measured on the CPU (largest difference seen -> bound): fp32 logits 2.4e-7 and hidden
states 9.5e-7 -> 1e-5, also for each experts implementation (2.4e-7; 0 where ours runs
transformers' own); router logits 1.6e-7, with MegaGate 1.5e-7 -> 1e-6, aux loss and loss 0 ->
1e-6; gradients against transformers' 6e-8 (of gradients up to 0.17) -> 1e-6, with checkpointing
against without 0 -> 1e-7; bf16 logits against transformers' bf16 model (logits of order 0.7;
bf16 rounding flips routing choices, so single logits move by a few bf16 ulps) mean |difference|
1.2e-3 -> 0.01, largest 0.035 (over seeds) -> 0.25, and ours' largest error against the fp32
model at most 1.04x transformers' bf16 model's -> 2x.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from torch import nn

from hyperparallel.errors import ConfigError
from hyperparallel.models import build_model, get_family, swap_moe_blocks
from hyperparallel.models.kernels import use_kernels
from hyperparallel.moe import GroupedExperts, MoEBlock, TopKRouter
from hyperparallel.moe.experts import EXPERTS_IMPLEMENTATION

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
# (family, tiny config, MoE layers)
FAMILIES = [("qwen3_moe", "qwen3_moe_tiny", 2), ("deepseek_v3", "deepseek_v3_tiny", 2), ("kimi_k2", "kimi_k2_tiny", 2),
            ("deepseek_v4", "deepseek_v4_tiny", 4)]
SEED = 3

FORWARD_ATOL = 1e-5  # logits and hidden states, ours against transformers' eager experts
ROUTER_ATOL = 1e-6  # recorded router logits and the aux loss
GRAD_ATOL = 1e-6  # gradients against transformers'
RECOMPUTE_ATOL = 1e-7  # gradients with checkpointing against ours without
BF16_MEAN_ATOL = 0.01  # bf16 logits against transformers' bf16 model: mean |difference|
BF16_MAX_ATOL = 0.25  # ... and the largest
BF16_ERROR_RATIO = 2.0  # ours' largest error against the fp32 model, in transformers' bf16 model's


def tiny(name: str) -> dict:
    return yaml.safe_load((CONFIGS / f"{name}.yaml").read_text())


@dataclass
class Pair:
    family: str
    name: str
    moe_layers: int
    hf: nn.Module  # transformers' blocks, eager experts
    ours: nn.Module  # the same weights, our blocks

    @property
    def vocab_size(self) -> int:
        return self.hf.config.vocab_size

    def copies(self) -> tuple[nn.Module, nn.Module]:
        return copy.deepcopy(self.hf), copy.deepcopy(self.ours)


@pytest.fixture(scope="module", params=FAMILIES, ids=[f for f, _, _ in FAMILIES])
def built(request) -> Pair:
    """The family's pair, built once per module and never run (tests use copies: hooks that
    transformers installs on a first forward, set implementations and kernels stay theirs)."""
    family, name, moe_layers = request.param
    hf = build_model(family, config=tiny(name), seed=SEED, grouped_experts=False).eval()
    ours = copy.deepcopy(hf)
    assert swap_moe_blocks(ours) == moe_layers
    hf.set_experts_implementation("eager")  # transformers' reference loop (ours runs "hyperparallel")
    return Pair(family, name, moe_layers, hf, ours)


@pytest.fixture
def pair(built) -> Pair:
    hf, ours = built.copies()
    return Pair(built.family, built.name, built.moe_layers, hf, ours)


def batch(vocab_size: int, seed: int = 1, shape=(2, 32)) -> torch.Tensor:
    return torch.randint(0, vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def padded_mask(ids: torch.Tensor) -> torch.Tensor:
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # the second row left-padded
    return mask


def routers(model: nn.Module) -> list[TopKRouter]:
    return [m for m in model.modules() if isinstance(m, TopKRouter)]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------------ forward


def test_fp32_forward_matches_transformers(pair):
    ids = batch(pair.vocab_size)
    with torch.no_grad():
        o = pair.ours(input_ids=ids, output_hidden_states=True)
        h = pair.hf(input_ids=ids, output_hidden_states=True)
    assert len(o.hidden_states) == len(h.hidden_states) == pair.hf.config.num_hidden_layers + 1
    for layer, (a, b) in enumerate(zip(o.hidden_states, h.hidden_states, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=FORWARD_ATOL, msg=lambda m, i=layer: f"hidden state {i}: {m}")
    torch.testing.assert_close(o.logits, h.logits, rtol=0, atol=FORWARD_ATOL)


# ------------------------------------------------------------------------------ router logits


def check_router_outputs(o, h, ours: nn.Module, *, atol: float = ROUTER_ATOL) -> None:
    """ours' recorded router logits, aux loss and loss are transformers'."""
    assert h.router_logits, "transformers recorded no router logits"
    # transformers records the learned routers only (DeepSeek-V4's hash-routed layers are not its
    # recorder's class): ours must record the same layers, in the same order
    recorded = sum(not r.hash_routing for r in routers(ours))
    assert len(h.router_logits) == recorded
    assert len(o.router_logits) == len(h.router_logits), (
        f"ours recorded {len(o.router_logits)} router logits, transformers {len(h.router_logits)}")
    for layer, (a, b) in enumerate(zip(o.router_logits, h.router_logits, strict=True)):
        assert a.shape == b.shape and a.dtype == b.dtype, (layer, a.shape, b.shape, a.dtype, b.dtype)
        torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m, i=layer: f"router logits {i}: {m}")
    if h.aux_loss is None:  # DeepSeek-V3 computes no aux loss
        assert o.aux_loss is None
    else:
        torch.testing.assert_close(o.aux_loss, h.aux_loss, rtol=0, atol=ROUTER_ATOL)
    if h.loss is not None:
        torch.testing.assert_close(o.loss, h.loss, rtol=0, atol=ROUTER_ATOL)


@pytest.mark.parametrize("how", ["argument", "config"])
def test_router_logits_are_transformers(pair, how):
    ids = batch(pair.vocab_size)
    if how == "config":
        pair.hf.config.output_router_logits = pair.ours.config.output_router_logits = True
        kwargs = {}
    else:
        kwargs = {"output_router_logits": True}
    with torch.no_grad():
        h = pair.hf(input_ids=ids, labels=ids, **kwargs)
        o = pair.ours(input_ids=ids, labels=ids, **kwargs)
    check_router_outputs(o, h, pair.ours)
    tokens, experts = ids.numel(), routers(pair.ours)[-1].num_experts
    assert all(t.shape == (tokens, experts) for t in o.router_logits)


def check_padded_router_outputs(pair: Pair) -> None:
    ids = batch(pair.vocab_size)
    mask = padded_mask(ids)
    with torch.no_grad():
        h = pair.hf(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
        o = pair.ours(input_ids=ids, attention_mask=mask, labels=ids, output_router_logits=True)
    check_router_outputs(o, h, pair.ours)


def test_router_logits_with_a_padded_attention_mask(pair):
    check_padded_router_outputs(pair)


def test_router_logits_with_mega_gate(pair):
    report = use_kernels(pair.ours, mega_gate=True, mega_mhc=False)
    assert report.mega_gate == pair.moe_layers and all(r.fused for r in routers(pair.ours))
    check_padded_router_outputs(pair)


# --------------------------------------------------------------------- experts implementation


@pytest.mark.parametrize("implementation", ["eager", "batched_mm", "grouped_mm"])
def test_experts_implementation_gives_transformers_outputs(pair, implementation):
    """As transformers' own test of it: each implementation is called through the interface's
    mapping (mocks wrapping transformers' functions), and gives the eager loop's outputs; our own
    comes back with set_experts_implementation("hyperparallel")."""
    from unittest.mock import Mock, patch

    from transformers.integrations import moe as hf_moe

    assert pair.ours.config._experts_implementation == EXPERTS_IMPLEMENTATION
    mocks = {name: Mock(wraps=hf_moe.ALL_EXPERTS_FUNCTIONS[name]) for name in ("batched_mm", "grouped_mm")}
    ids = batch(pair.vocab_size)
    with patch.dict("transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS._global_mapping", mocks), torch.no_grad():
        pair.ours.set_experts_implementation(implementation)
        assert pair.ours.config._experts_implementation == implementation
        o = pair.ours(input_ids=ids).logits
        for name, mock in mocks.items():
            assert mock.called == (name == implementation)
        h = pair.hf(input_ids=ids).logits
        pair.ours.set_experts_implementation(EXPERTS_IMPLEMENTATION)
        back = pair.ours(input_ids=ids).logits
    torch.testing.assert_close(o, h, rtol=0, atol=FORWARD_ATOL)
    torch.testing.assert_close(back, h, rtol=0, atol=FORWARD_ATOL)


@pytest.mark.parametrize("implementation", ["deepgemm", "sonicmoe"])
def test_other_experts_implementations_run_transformers_own(pair, implementation):
    """Any other implementation transformers accepts runs transformers' own on our Parameters: the
    same outcome as transformers' model (here, on the CPU, its own error), never ours in silence."""
    ids = batch(pair.vocab_size, shape=(1, 8))
    outcomes = []
    for model in (pair.hf, pair.ours):
        model.set_experts_implementation(implementation)
        try:
            with torch.no_grad():
                outcomes.append(model(input_ids=ids).logits)
        except Exception as error:  # noqa: BLE001 (transformers' own error, whatever it is, compared)
            outcomes.append((type(error), str(error)))
    theirs, ours = outcomes
    if isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=FORWARD_ATOL)
    else:
        assert ours == theirs


def test_an_implementation_that_would_drop_mxfp8_is_refused(pair):
    """Under an MXFP8 recipe transformers' implementations would compute in high precision: refused,
    naming what ours run, when the model runs."""
    from hyperparallel.lowp import LowPrecisionConfig, convert

    convert(pair.ours, LowPrecisionConfig(enabled=True, modules=["experts"]))
    ids = batch(pair.vocab_size, shape=(1, 8))
    with torch.no_grad():
        pair.ours(input_ids=ids)  # (ours, in MXFP8)
        pair.ours.set_experts_implementation("eager")
        with pytest.raises(ConfigError, match=r"(?is)'eager'.*mxfp8.*'hyperparallel'"):
            pair.ours(input_ids=ids)


def test_an_implementation_that_would_drop_expert_parallelism_is_refused(pair):
    """Expert parallelism calls the experts with rows sorted by expert (`offsets`): transformers'
    implementations take every expert's tokens on one rank, so they are refused there."""
    pair.ours.set_experts_implementation("batched_mm")
    experts = next(m for m in pair.ours.modules() if isinstance(m, GroupedExperts))
    rows = torch.randn(4, experts.hidden_dim)
    offsets = torch.full((experts.num_experts,), 4, dtype=torch.int32)
    with pytest.raises(ConfigError, match=r"(?s)'batched_mm'.*expert parallelism.*'hyperparallel'"):
        experts(rows, offsets=offsets)


def test_where_transformers_cannot_choose_the_implementation_ours_stay_ours(built):
    """A model class whose implementation transformers will not let be chosen (it cannot read its
    source) runs transformers' eager loop whatever the config says: after the swap, ours run their
    grouped products, MXFP8 included, instead of following the config there."""
    from hyperparallel.lowp import LowPrecisionConfig, convert

    spec = get_family(built.family)

    class Unreadable(spec.model_class):
        @classmethod
        def _can_set_experts_implementation(cls) -> bool:
            return False

    model = copy.deepcopy(built.hf)  # (its config asks for eager)
    model.__class__ = Unreadable
    assert model.config._experts_implementation == "eager"
    swap_moe_blocks(model)
    convert(model, LowPrecisionConfig(enabled=True, modules=["experts"]))
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=batch(built.hf.config.vocab_size, shape=(1, 8))).logits).all()
    assert all(m.transformers_implementation() is None for m in model.modules() if isinstance(m, GroupedExperts))


def test_the_swap_keeps_our_forward_when_transformers_modules_were_compiled(built):
    """What torch or a library binds to the replaced module's instance (Module.compile's compiled
    call, say) does not come with the swap: ours run their own forward."""
    hf = copy.deepcopy(built.hf)
    replaced = [m for m in hf.modules() if isinstance(m, get_family(built.family).router_classes)]
    for module in replaced:
        module.compile()
    swap_moe_blocks(hf)
    assert all(r._compiled_call_impl is None for r in routers(hf))


# ------------------------------------------------------------------------------- save / load


def test_save_pretrained_then_load_gives_the_same_model(pair, tmp_path):
    pair.ours.save_pretrained(tmp_path)
    loaded = build_model(pair.family, path=tmp_path).eval()

    assert [type(m) for m in loaded.modules()] == [type(m) for m in pair.ours.modules()]
    saved, state = pair.ours.state_dict(), loaded.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved), [k for k in saved if not torch.equal(state[k], saved[k])]
    ids = batch(pair.vocab_size)
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
        torch.testing.assert_close(logits, pair.ours(input_ids=ids).logits, rtol=0, atol=0)
        torch.testing.assert_close(logits, pair.hf(input_ids=ids).logits, rtol=0, atol=FORWARD_ATOL)


# ---------------------------------------------------------------------------- initialization

INIT_STD = 0.05  # initializer_range for the init tests: far from the tiny configs' 0.02


def clear_initialized_marks(model: nn.Module) -> None:
    for obj in [*model.modules(), *model.parameters(), *model.buffers()]:
        obj.__dict__.pop("_is_hf_initialized", None)


def check_normal(name: str, tensor: torch.Tensor, std: float) -> None:
    """`tensor` looks drawn from normal(0, std): finite, its std within 10%, its mean within five
    standard errors of 0."""
    t = tensor.detach().double()
    assert torch.isfinite(t).all(), f"{name} is not finite after init"
    assert abs(t.std().item() - std) < 0.1 * std, f"{name}: std {t.std().item():.4g}, expected {std}"
    assert abs(t.mean().item()) < 5 * std / t.numel() ** 0.5, f"{name}: mean {t.mean().item():.3g}"


def moe_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Our routers' weights and correction biases and our experts' weights, by name."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, (TopKRouter, GroupedExperts)):
            for tensor_name in ("weight", "e_score_correction_bias", "gate_up_proj", "down_proj"):
                tensor = getattr(module, tensor_name, None)
                if tensor is not None:
                    out[f"{name}.{tensor_name}"] = tensor
    return out


def test_init_weights_initializes_our_modules(pair):
    model = pair.ours
    model.config.initializer_range = INIT_STD
    clear_initialized_marks(model)
    tensors = moe_tensors(model)
    assert len(tensors) >= 3 * pair.moe_layers
    with torch.no_grad():
        for tensor in tensors.values():
            tensor.fill_(float("nan"))
    torch.manual_seed(0)
    model.init_weights()
    for name, tensor in tensors.items():
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(tensor, torch.zeros_like(tensor)), f"{name} is not zero after init"
        else:
            check_normal(name, tensor, INIT_STD)


def test_init_weights_is_seeded_as_transformers(pair):
    for model in (pair.hf, pair.ours):
        clear_initialized_marks(model)
        torch.manual_seed(11)
        model.init_weights()
    theirs, ours = pair.hf.state_dict(), pair.ours.state_dict()
    assert ours.keys() == theirs.keys()
    differ = [k for k in theirs if not torch.equal(ours[k], theirs[k])]
    assert not differ, f"init_weights() from one seed differs with our blocks: {len(differ)} tensors, {differ[:8]}"


# the checkpoint's keys (transformers may save experts per expert, or DeepSeek-V4's own names) left
# out of layer 1's MoE block: the router's weight and correction bias, the experts' down projection
_LAYER_1_MOE = re.compile(r"(^|\.)layers\.1\.(mlp|ffn)\.")


def _missing_in_checkpoint(key: str) -> bool:
    if not _LAYER_1_MOE.search(key) or "shared_experts" in key:
        return False
    router = key.endswith((".gate.weight", ".gate.bias", ".gate.e_score_correction_bias"))
    down = ".experts." in key and ("down_proj" in key or ".w2." in key)
    return router or down


def test_missing_keys_on_load_are_initialized(built, tmp_path):
    spec = get_family(built.family)
    reference = copy.deepcopy(built.hf)
    reference.config.initializer_range = INIT_STD  # what the missing tensors must be drawn with
    with torch.no_grad():  # a bias that is not zero: loaded, it would show
        for module in reference.modules():
            if isinstance(getattr(module, "e_score_correction_bias", None), torch.Tensor):
                module.e_score_correction_bias.fill_(0.5)
    reference.save_pretrained(tmp_path)
    checkpoint = tmp_path / "model.safetensors"
    weights = load_file(checkpoint)
    dropped = [k for k in weights if _missing_in_checkpoint(k)]
    assert dropped
    save_file({k: v for k, v in weights.items() if k not in dropped}, checkpoint, metadata={"format": "pt"})

    class Swapped(spec.model_class):  # transformers' model class, our blocks from its construction on
        def __init__(self, config):
            super().__init__(config)
            swap_moe_blocks(self)

    Swapped.__module__ = spec.model_class.__module__  # (transformers reads its module's source)
    model = Swapped.from_pretrained(tmp_path, attn_implementation=spec.attention_implementations[0])
    block = model.model.layers[1].mlp
    assert isinstance(block, MoEBlock)

    missing = {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"}
    if block.gate.e_score_correction_bias is not None:
        missing.add("model.layers.1.mlp.gate.e_score_correction_bias")
    state, expected = model.state_dict(), reference.state_dict()
    assert state.keys() == expected.keys()
    for key in sorted(missing):
        if key.endswith("e_score_correction_bias"):
            assert torch.equal(state[key], torch.zeros_like(state[key])), f"missing {key} is not zero"
        else:
            check_normal(f"missing {key}", state[key], INIT_STD)
    kept = [k for k in expected if k not in missing]
    changed = [k for k in kept if not torch.equal(state[k], expected[k])]
    assert not changed, f"loaded tensors changed: {changed}"


# ---------------------------------------------------------------------------------- generate


def test_generate_gives_transformers_tokens_with_and_without_cache(pair):
    prompt = batch(pair.vocab_size, seed=4, shape=(2, 13))
    tokens = {}
    for who, model in (("hf", pair.hf), ("ours", pair.ours)):
        for use_cache in (True, False):
            tokens[who, use_cache] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                                                    do_sample=False, use_cache=use_cache, pad_token_id=0)
    reference = tokens["hf", True]
    assert reference.shape == (2, 13 + 6) and torch.equal(reference[:, :13], prompt)
    for key, generated in tokens.items():
        assert torch.equal(generated, reference), (key, generated, reference)


# ------------------------------------------------------------------------ gradient checkpointing


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def test_gradient_checkpointing_gives_the_same_gradients(pair):
    ids = batch(pair.vocab_size)
    recomputed = copy.deepcopy(pair.ours)
    recomputed.gradient_checkpointing_enable()
    layers = [m for m in recomputed.modules() if getattr(m, "gradient_checkpointing", False)]
    assert len(layers) >= pair.hf.config.num_hidden_layers  # every decoder layer recomputes

    loss, grads = loss_and_grads(recomputed, ids)
    plain_loss, plain = loss_and_grads(pair.ours, ids)
    hf_loss, theirs = loss_and_grads(pair.hf, ids)

    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=RECOMPUTE_ATOL)
    torch.testing.assert_close(loss, hf_loss, rtol=0, atol=ROUTER_ATOL)
    assert grads.keys() == plain.keys() == theirs.keys()
    for name, grad in grads.items():
        assert (grad is None) == (plain[name] is None) == (theirs[name] is None), name
        if grad is None:  # (DeepSeek-V4's lightning indexer: transformers gives it no gradient)
            continue
        torch.testing.assert_close(grad, plain[name], rtol=0, atol=RECOMPUTE_ATOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(grad, theirs[name], rtol=0, atol=GRAD_ATOL, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------------------------------------------- dtype


def test_to_bfloat16_runs_close_to_transformers(pair):
    ids = batch(pair.vocab_size)
    with torch.no_grad():
        exact = pair.hf(input_ids=ids).logits
        hf, ours = pair.hf.to(torch.bfloat16), pair.ours.to(torch.bfloat16)
        assert all(p.dtype == torch.bfloat16 for p in ours.parameters())
        o = ours(input_ids=ids).logits
        h = hf(input_ids=ids).logits
    assert o.dtype == h.dtype == torch.bfloat16
    assert torch.isfinite(o).all()
    # bf16 rounding (and the routing choices it flips) moves single logits by a few bf16 ulps
    # either way: bound the mean and the worst difference, and ours' error against fp32 by
    # transformers' own
    difference = (o.float() - h.float()).abs()
    assert difference.mean().item() < BF16_MEAN_ATOL, difference.mean().item()
    assert difference.max().item() < BF16_MAX_ATOL, difference.max().item()
    assert max_diff(o, exact) <= BF16_ERROR_RATIO * max_diff(h, exact), (max_diff(o, exact), max_diff(h, exact))
