"""linear_cross_entropy and FusedLossHead give Hugging Face's causal-LM loss and its gradients.

Tolerances: float32 losses agree with HF's ForCausalLMLoss to rel 1e-6 and gradients to 1e-6
absolute on values of order 1e-3 (the log-sum-exp and the head's matmuls sum in another order);
under bf16 autocast both compute the head in bf16 and agree to rel 1e-3 (loss) and 2 bf16 ulps of
the largest gradient.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from transformers.loss.loss_utils import ForCausalLMLoss

from hyperparallel.models import FusedLossHead, build_model, fused_loss, install_fused_loss, linear_cross_entropy
from hyperparallel.models import loss as loss_module

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
VOCAB = 300


def inputs(batch=3, seq=17, hidden=24, ignored=5, seed=0):
    torch.manual_seed(seed)
    h = torch.randn(batch, seq, hidden, requires_grad=True)
    w = (torch.randn(VOCAB, hidden) * 0.2).requires_grad_()
    labels = torch.randint(0, VOCAB, (batch, seq))
    labels.view(-1)[torch.randperm(batch * seq)[:ignored]] = -100
    return h, w, labels


def loss_and_grads(fn, h, w):
    loss = fn()
    grad_h, grad_w = torch.autograd.grad(loss * 3.0, (h, w))  # a non-unit incoming gradient
    return loss.detach(), grad_h, grad_w


def hf_loss(h, w, labels, **kwargs):
    return ForCausalLMLoss(F.linear(h, w), labels, VOCAB, **kwargs)


@pytest.mark.parametrize("chunk_elements", [VOCAB * 7, VOCAB * 64, 1 << 21])  # ragged chunks .. one chunk
@pytest.mark.parametrize("num_items", [None, 40])
def test_matches_hf_loss_and_gradients_fp32(monkeypatch, chunk_elements, num_items):
    monkeypatch.setattr(loss_module, "_CHUNK_ELEMENTS", chunk_elements)
    monkeypatch.setattr(loss_module, "_MIN_CHUNK_ROWS", 1)
    h, w, labels = inputs()
    kwargs = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    want = loss_and_grads(lambda: hf_loss(h, w, labels, **kwargs), h, w)
    got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, **kwargs), h, w)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def test_given_shift_labels_and_no_grad():
    h, w, labels = inputs(seed=1)
    shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
    want = hf_loss(h, w, labels)
    torch.testing.assert_close(linear_cross_entropy(h, w, shift_labels=shifted), want, rtol=1e-6, atol=0)
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, labels)
    assert loss.grad_fn is None
    torch.testing.assert_close(loss, want.detach(), rtol=1e-6, atol=0)


def test_every_label_ignored_gives_nan_as_torch_does():
    h, w, labels = inputs(seed=2)
    labels[:] = -100
    assert torch.isnan(linear_cross_entropy(h, w, labels)) and torch.isnan(hf_loss(h, w, labels))


def test_bf16_autocast_computes_the_head_in_bf16_like_hf():
    h, w, labels = inputs(seed=3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = loss_and_grads(lambda: hf_loss(h, w, labels), h, w)
        got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels), h, w)
    assert got[1].dtype == got[2].dtype == torch.float32  # gradients in the parameters' dtype
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=0)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2.0**-6 * ref.abs().max().item())


def test_compiled_chunks_give_the_same_numbers(monkeypatch):
    monkeypatch.setattr(loss_module, "_WHOLE_ELEMENTS", 0)  # (chunks at every size)
    h, w, labels = inputs(seed=4)
    want = loss_and_grads(lambda: linear_cross_entropy(h, w, labels), h, w)
    got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, compile="dvm"), h, w)
    for g, ref in zip(got, want, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["inductor", "dvm"])
def test_small_logits_compiled_whole_give_hfs_numbers(backend):
    h, w, labels = inputs(seed=6)
    kwargs = {"num_items_in_batch": torch.tensor(40)}
    want = loss_and_grads(lambda: hf_loss(h, w, labels, **kwargs), h, w)
    got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, compile=backend, **kwargs), h, w)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the products in bf16, as the chunks and HF compute them
        want = loss_and_grads(lambda: hf_loss(h, w, labels), h, w)
        got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, compile=backend), h, w)
    assert got[1].dtype == got[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-3, atol=0)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=2e-2, atol=2.0**-6 * ref.abs().max().item())


def test_terms_far_below_the_row_peak_are_zero_and_the_loss_is_hfs(monkeypatch):
    monkeypatch.setattr(loss_module, "_WHOLE_ELEMENTS", 0)  # (the chunks, which compute the numerators)
    logits = torch.tensor([[3.0, 3.0 - 49.9, 3.0 - 50.1, -300.0]])
    got = loss_module.softmax_numerators(logits, logits.amax(dim=1, keepdim=True))
    assert got[0, 0] == 1 and got[0, 1] == torch.exp(torch.tensor(-49.9)) and got[0, 2] == got[0, 3] == 0
    # logits spread over hundreds (a trained head's are over tens): the dropped terms change nothing
    h, w, labels = inputs(seed=5)
    w = (w.detach() * 60).requires_grad_()
    spread = F.linear(h, w).amax(-1) - F.linear(h, w).amin(-1)
    assert spread.min() > 100
    want = loss_and_grads(lambda: hf_loss(h, w, labels), h, w)
    got = loss_and_grads(lambda: linear_cross_entropy(h, w, labels, compile="inductor"), h, w)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=0)
    for g, ref in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-5, atol=1e-6)


def tiny_model():
    config = yaml.safe_load((CONFIGS / "qwen3_tiny.yaml").read_text())
    return build_model("qwen3", config={**config, "vocab_size": VOCAB, "tie_word_embeddings": True}, seed=5)


def test_installed_head_gives_the_models_own_loss_and_gradients():
    reference, model = tiny_model(), tiny_model()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert install_fused_loss(model) and isinstance(model.lm_head, FusedLossHead)
    assert dict(model.named_parameters(remove_duplicate=False)).keys() == params.keys()
    assert all(p is params[name] for name, p in model.named_parameters(remove_duplicate=False))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    ids = torch.randint(0, VOCAB, (2, 12))

    want = reference(input_ids=ids, labels=ids).loss
    want.backward()
    with fused_loss(model):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want, rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    # outside the block the head is a plain linear layer again
    logits = model(input_ids=ids).logits
    assert logits.shape == (2, 12, VOCAB)
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, want, rtol=1e-6, atol=0)


def test_heads_it_cannot_take_are_left_alone():
    model = tiny_model()
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(model.lm_head.in_features, VOCAB, bias=True)
    assert not install_fused_loss(model) and type(model.lm_head) is torch.nn.Linear
    with fused_loss(model):  # a model without a FusedLossHead runs as it is
        assert model(input_ids=torch.randint(0, VOCAB, (1, 4))).logits.shape == (1, 4, VOCAB)


def test_a_loss_from_something_else_than_the_head_is_refused():
    model = tiny_model()
    install_fused_loss(model)
    with fused_loss(model), pytest.raises(RuntimeError, match="other than the lm_head's output"):
        model.loss_function(torch.randn(2, 3, VOCAB), torch.zeros(2, 3, dtype=torch.long), VOCAB)
