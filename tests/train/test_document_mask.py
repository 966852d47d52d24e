"""Packed documents with document masking: each document's loss packed equals its loss alone.

The trainer packs documents into a row of S tokens and gives position_ids that restart at 0 at
every document start (the labels at a document's first token are -100, so no label crosses a
boundary; the padding at the row's end is labelled -100 and numbered from 0 like a document).
With attention_mask None, transformers' masking_utils (`find_packed_sequence_indices`) reads the
restarts as document boundaries and builds a block-diagonal causal mask (sdpa and eager alike),
and rotary embeddings see each document's own positions. Everything else in these models works
token by token: norms, MLPs, DeepSeek-V4's hyper-connections (MegaMHC) and our MoE blocks, whose
routing is capacity-free top-k (MegaGate, or DeepSeek-V4's token-id hash), so packing changes no
token's experts (checked below).

Each family is built as the trainer builds it (our MoE blocks, the kernels on, the fused loss
installed), tiny, fp32, seeded. Three documents of different lengths (one longer than
DeepSeek-V4's 32-token sliding window) are packed into one row; each document's summed
cross-entropy (from the logits) is compared with the same document run alone in a row of its own.

Measured over seeds 0..4, packed vs alone: a document's summed loss 3.3e-8 relative apart at
most, one token's loss 9.5e-7 (many exactly equal). Without the restarting position_ids (seed 0, the
negative control) the second and third documents attend to the earlier ones: their summed losses
8.6e-4 relative apart or more, their most different tokens 0.15 or more; so too (4e-3, 0.15) with
the restarts kept for the rotary embeddings but transformers' packed-sequence mask switched off.

DeepSeek-V4 does not hold (its registry entry's `document_mask` says why): the compressed
attention layers (CSA, HCA) compress the row in windows counted from its first token
and show a token the entries 0 .. (position_id + 1) // compress_rate - 1, so a later document
reads the first one's compressed entries. With only sliding-window layers the same model holds.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from hyperparallel.models import FAMILIES, build_model, document_mask_problem, fused_loss, install_fused_loss
from hyperparallel.models.families import ALIASES
from hyperparallel.models.kernels import use_kernels
from hyperparallel.models.tiny import tiny_config_values
from hyperparallel.moe import TopKRouter

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "models"
ROW = 64
LENGTHS = (35, 8, 17)  # + 4 padding; 35 > DeepSeek-V4's sliding window (32), 17 > its HCA rate (16)
# packed vs alone (measured over seeds 0..4, every case): a document's summed loss 3.3e-8 relative
# apart at most, a token's loss 9.5e-7; the mean losses of the fused loss and transformers' (and
# the routing weights) 3.1e-7 relative
RTOL, ATOL, LOSS_RTOL = 1e-6, 1e-5, 5e-6
# a document that sees another (seed 0, the negative control and DeepSeek-V4's compressed
# layers): its summed loss 8.6e-4 relative apart or more, its most different token 6.4e-2 or more
LEAK_SUMMED, LEAK_TOKEN = 1e-4, 1e-2
IGNORE = -100


@dataclass(frozen=True)
class Case:
    family: str
    config: str
    attn_implementation: str | None = None  # None: the family's default (sdpa; eager for DeepSeek-V4)
    overrides: tuple = field(default=())  # (key, value) pairs over the tiny config

    @property
    def id(self) -> str:
        return "-".join([self.family, *([self.attn_implementation] if self.attn_implementation else []),
                         *(k for k, _ in self.overrides)])


# any causal LM of transformers (no tuned family): masks where `document_mask_problem` finds none
# (Gemma 3: sliding windows of 16 tokens, shorter than the first document), refused where it names
# a reason: Mamba's recurrent state, Zaya's convolution over the sequence, GPT-OSS's forward that
# builds its masks without the positions, BLT's global model whose mask is given none
GENERIC = [Case("llama", ""), Case("gemma3_text", ""), Case("mixtral", "")]
GENERIC_REFUSED = [Case("mamba", ""), Case("zaya", ""), Case("gpt_oss", ""), Case("blt", "")]
SLIDING_ONLY_V4 = (("layer_types", ("sliding_attention",) * 4),)
# (qwen3 twice: sdpa's mask and eager's; kimi_k2 is DeepSeek-V3 with yarn rope)
SUPPORTED = [Case("qwen3", "qwen3_tiny"), Case("qwen3", "qwen3_tiny", "eager"), Case("qwen3_moe", "qwen3_moe_tiny"),
             Case("deepseek_v3", "deepseek_v3_tiny"), Case("kimi_k2", "kimi_k2_tiny")]
V4 = Case("deepseek_v4", "deepseek_v4_tiny")
V4_SLIDING = Case("deepseek_v4", "deepseek_v4_tiny", overrides=SLIDING_ONLY_V4)
MOE = [*(c for c in SUPPORTED if c.family != "qwen3"), V4_SLIDING]


@functools.cache
def model_of(case: Case, seed: int):
    """The family as the trainer builds it: our MoE blocks, MegaGate and MegaMHC on, the fused loss."""
    path = CONFIGS / f"{case.config}.yaml"
    config = yaml.safe_load(path.read_text()) if path.is_file() else tiny_config_values(case.family)
    config.update({k: list(v) if isinstance(v, tuple) else v for k, v in case.overrides})
    model = build_model(case.family, config=config, attn_implementation=case.attn_implementation, seed=seed)
    use_kernels(model, mega_gate=True, mega_mhc=True)
    assert install_fused_loss(model)
    return model


def documents(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


@dataclass(frozen=True)
class Row:
    """One packed row, as the trainer feeds it (tensors [1, S])."""

    input_ids: torch.Tensor
    labels: torch.Tensor  # -100 at each document's first token and on the padding
    position_ids: torch.Tensor  # restarting at 0 at each document (and at the padding)
    spans: list[tuple[int, int]]  # each document's [start, end) in the row

    def keeping(self, doc: int) -> torch.Tensor:
        """The labels with only document `doc`'s kept."""
        start, end = self.spans[doc]
        kept = torch.full_like(self.labels, IGNORE)
        kept[:, start:end] = self.labels[:, start:end]
        return kept


def pack(docs: list[torch.Tensor], length: int) -> Row:
    ids = torch.zeros(length, dtype=torch.long)
    labels = torch.full((length,), IGNORE)
    positions = torch.zeros(length, dtype=torch.long)
    spans, start = [], 0
    for doc in docs:
        end = start + len(doc)
        ids[start:end], labels[start + 1:end] = doc, doc[1:]
        positions[start:end] = torch.arange(len(doc))
        spans.append((start, end))
        start = end
    positions[start:] = torch.arange(length - start)
    return Row(ids[None], labels[None], positions[None], spans)


def token_losses(model, input_ids: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None
                 ) -> torch.Tensor:
    """[B, S]: each position's cross-entropy for the next token (0 where that label is -100),
    from the logits, float64."""
    with torch.no_grad():
        logits = model(input_ids=input_ids, position_ids=position_ids).logits.float()
    targets = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none").double()


def row_losses(model, row: Row, *, restart: bool = True) -> torch.Tensor:
    """[S]: the row's token losses (restart False: position_ids None, 0 .. S-1)."""
    return token_losses(model, row.input_ids, row.labels, row.position_ids if restart else None)[0]


def alone_losses(model, doc: torch.Tensor) -> torch.Tensor:
    """[len(doc)]: the document's token losses in a row of its own."""
    return row_losses(model, pack([doc], len(doc)))


def document_token_losses(case: Case, seed: int = 0, *, restart: bool = True
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per document, (its tokens' losses packed, the same alone), float64."""
    model = model_of(case, seed)
    docs = documents(model.config.vocab_size, seed)
    row = pack(docs, ROW)
    packed = row_losses(model, row, restart=restart)
    return [(packed[start:end], alone_losses(model, doc)) for (start, end), doc in zip(row.spans, docs, strict=True)]


def differences(case: Case, seed: int = 0, *, restart: bool = True) -> list[tuple[float, float]]:
    """Per document, (the relative difference of its summed loss packed vs alone, the largest
    difference of one of its tokens' losses)."""
    return [(abs(p.sum().item() - a.sum().item()) / a.sum().item(), (p - a).abs().max().item())
            for p, a in document_token_losses(case, seed, restart=restart)]


def test_the_cases_cover_every_family_the_registry_supports():
    supported = {name for name, family in FAMILIES.items() if family.document_mask is None}
    assert {ALIASES.get(c.family, c.family) for c in SUPPORTED} == supported
    assert FAMILIES["deepseek_v4"].document_mask  # a reason the trainer can print


def assert_each_document_as_alone(case: Case, seed: int = 0) -> None:
    for doc, (summed, token) in enumerate(differences(case, seed)):
        assert summed <= RTOL and token <= ATOL, f"document {doc}: summed loss {summed:.2e} relative, a token {token:.2e}"


@pytest.mark.parametrize("case", SUPPORTED, ids=lambda c: c.id)
def test_each_packed_document_has_the_loss_it_has_alone(case):
    assert_each_document_as_alone(case)


@pytest.mark.parametrize("case", [SUPPORTED[0], SUPPORTED[3]], ids=lambda c: c.id)
@pytest.mark.parametrize("seed", [1, 2])
def test_it_holds_for_other_seeds(case, seed):
    assert_each_document_as_alone(case, seed)


@pytest.mark.parametrize("case", [SUPPORTED[2], SUPPORTED[3]], ids=lambda c: c.id)
def test_a_micro_batch_of_rows_packed_differently(case):
    """Two rows, [B=2, S]: the documents in another order in the second, whose padding continues
    the last document's positions instead of restarting (it then joins that document, which
    never sees it: causal). Every document of either row has its loss alone."""
    model = model_of(case, 0)
    docs = documents(model.config.vocab_size)
    orders = [(0, 1, 2), (2, 1, 0)]
    rows = [pack([docs[i] for i in order], ROW) for order in orders]
    last_start, last_end = rows[1].spans[-1]
    rows[1].position_ids[0, last_end:] = torch.arange(last_end - last_start, ROW - last_start)
    packed = token_losses(model, *(torch.cat([getattr(r, name) for r in rows])
                                   for name in ("input_ids", "labels", "position_ids")))
    alone = [alone_losses(model, doc) for doc in docs]
    for b, (row, order) in enumerate(zip(rows, orders, strict=True)):
        for (start, end), doc in zip(row.spans, order, strict=True):
            want = alone[doc]
            assert abs(packed[b, start:end].sum().item() - want.sum().item()) <= RTOL * want.sum().item()
            assert (packed[b, start:end] - want).abs().max().item() <= ATOL


def assert_later_documents_differ(case: Case, *, restart: bool) -> None:
    """The first document exact (causal: it sees only itself), the later ones not."""
    (first_summed, first_token), *later = differences(case, restart=restart)
    assert first_summed <= RTOL and first_token <= ATOL
    assert all(summed > LEAK_SUMMED and token > LEAK_TOKEN for summed, token in later), later


@pytest.mark.parametrize("case", SUPPORTED, ids=lambda c: c.id)
def test_without_restarting_positions_later_documents_see_earlier_ones(case):
    """The negative control: the same packed row with position_ids None (0 .. S-1)."""
    assert_later_documents_differ(case, restart=False)


@pytest.mark.parametrize("case", [*SUPPORTED, V4_SLIDING], ids=lambda c: c.id)
def test_the_fused_loss_of_a_packed_row_is_transformers_loss_and_each_document_its_own(case):
    """The trainer's path: `with fused_loss(model)` (gradients on, as in training) gives
    transformers' mean loss over the packed row, which is the documents' losses alone summed
    over the row's counted tokens; with only one document's labels kept it is that document's
    mean loss alone."""
    model = model_of(case, 0)
    docs = documents(model.config.vocab_size)
    row = pack(docs, ROW)
    inputs = {"input_ids": row.input_ids, "position_ids": row.position_ids}
    with torch.no_grad():
        hf = model(**inputs, labels=row.labels).loss
    with fused_loss(model):
        fused = model(**inputs, labels=row.labels).loss
    assert fused.requires_grad
    torch.testing.assert_close(fused.detach(), hf, rtol=LOSS_RTOL, atol=0)
    alone = sum(a.sum().item() for _, a in document_token_losses(case))
    assert fused.item() == pytest.approx(alone / (row.labels != IGNORE).sum().item(), rel=LOSS_RTOL)
    with torch.no_grad(), fused_loss(model):
        for doc, tokens in enumerate(docs):
            one = pack([tokens], len(tokens))
            packed_doc = model(**inputs, labels=row.keeping(doc)).loss
            alone_doc = model(input_ids=one.input_ids, position_ids=one.position_ids, labels=one.labels).loss
            torch.testing.assert_close(packed_doc, alone_doc, rtol=LOSS_RTOL, atol=0)


def by_expert(indices: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's experts in ascending order, and their weights in that order."""
    order = indices.argsort(dim=1)
    return indices.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("case", MOE, ids=lambda c: c.id)
def test_moe_routing_is_per_token_so_packing_changes_no_tokens_experts(case):
    """Capacity-free top-k routing (and DeepSeek-V4's hash layer) picks a token's experts from its
    own hidden state (its id) alone: every MoE layer gives a document's tokens the same experts,
    with the same weights, packed as alone. (DeepSeek-V4 with sliding-window layers only: with
    its compressed layers the hidden states themselves differ.)"""
    model = model_of(case, 0)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(r.fused for r in routers)  # MegaGate, as the trainer runs them
    picks: list[tuple[torch.Tensor, torch.Tensor]] = []  # (indices, weights) [tokens, k] per router call
    hooks = [r.register_forward_hook(lambda _m, _a, out: picks.append((out[2], out[1]))) for r in routers]
    try:
        docs = documents(model.config.vocab_size)
        row = pack(docs, ROW)
        row_losses(model, row)
        packed = list(picks)
        assert len(packed) == len(routers)
        for (start, end), doc in zip(row.spans, docs, strict=True):
            picks.clear()
            alone_losses(model, doc)
            for (indices, weights), alone in zip(packed, picks, strict=True):
                got, want = by_expert(indices[start:end], weights[start:end]), by_expert(*alone)
                assert torch.equal(got[0], want[0])  # the same experts for every token
                torch.testing.assert_close(got[1], want[1], rtol=LOSS_RTOL, atol=0)
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("case", GENERIC, ids=lambda c: c.id)
def test_any_causal_lm_whose_token_mixing_is_masked_attention_keeps_documents_apart(case):
    assert document_mask_problem(model_of(case, 0)) is None
    assert_each_document_as_alone(case)


@pytest.mark.parametrize("case", GENERIC_REFUSED, ids=lambda c: c.id)
def test_where_the_model_names_a_reason_later_documents_do_see_earlier_ones(case):
    """What the trainer then says when it turns masks off (or refuses data.document_mask: true)
    is so: the packed documents after the first do see it."""
    assert document_mask_problem(model_of(case, 0)) is not None
    assert_later_documents_differ(case, restart=True)


def test_deepseek_v4_holds_with_sliding_window_attention_only():
    """The same model with only sliding-window layers (window 32, the first document 35 tokens),
    MegaMHC, MegaGate and the hash-routed first layer: each document its own loss."""
    assert_each_document_as_alone(V4_SLIDING)


def test_deepseek_v4_compressed_attention_reads_other_documents():
    """Why its registry entry refuses document masking: with CSA / HCA layers, the documents after
    the first read the compressed entries of the row's first windows (the first document's)
    although their position_ids restart; the first document, whose windows are its own, stays
    exact."""
    assert_later_documents_differ(V4, restart=True)
