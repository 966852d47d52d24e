"""Corpus, tokenizer, packing and the resumable order of sequences."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hyperparallel.errors import ConfigError
from hyperparallel.train import data
from hyperparallel.train.config import DataSection

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))


def files_section(tmp_path, **kw) -> DataSection:
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": TEXT[i:]}) for i in range(0, 60, 20)) + "\n")
    pq.write_table(pa.table({"text": [TEXT, TEXT.upper()]}), tmp_path / "c.parquet")
    return DataSection(source="files", files=[str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"),
                                              str(tmp_path / "c.parquet")], vocab_size=300, seq_len=16, **kw)


def test_text_jsonl_and_parquet_files_make_one_corpus(tmp_path):
    docs = data.load_documents(files_section(tmp_path))
    assert len(docs) == 1 + 3 + 2 and docs[0] == TEXT and docs[-1] == TEXT.upper()


def test_the_stdlib_corpus_is_capped_and_fixed():
    cfg = DataSection(max_corpus_bytes=50_000)
    docs = data.load_documents(cfg)
    assert sum(map(len, docs)) == 50_000
    assert data.corpus_key(cfg, docs) == data.corpus_key(cfg, data.load_documents(cfg))


def test_builtin_tokenizer_is_trained_once_then_cached(tmp_path):
    first = data.prepare(files_section(tmp_path))
    cached = list((tmp_path / "cache").glob("tokenizer-*.json"))
    assert len(cached) == 1 and first.tokenizer.vocab_size <= 300
    again = data.prepare(files_section(tmp_path))
    assert torch.equal(first.sequences, again.sequences)
    ids = first.tokenizer.encode_batch(["return a + b"])[0]
    assert first.tokenizer.backend.decode(ids) == "return a + b"


def test_packing_fills_rows_and_unpacked_rows_are_padded(tmp_path):
    packed = data.prepare(files_section(tmp_path))
    assert packed.sequences.shape[1] == 16 and packed.sequences.shape[0] == packed.num_tokens // 16
    unpacked = data.prepare(files_section(tmp_path, packing=False))
    assert unpacked.sequences.shape == (5, 16) and unpacked.validation.shape == (1, 16)  # the last document held out
    short = data.build_sequences([torch.tensor([5, 6, 1]).numpy()], 8, False, pad_id=9)
    assert short.tolist() == [[5, 6, 1, 9, 9, 9, 9, 9]]


def test_validation_holds_out_the_end_of_the_corpus_or_reads_files_of_its_own(tmp_path):
    whole = data.prepare(files_section(tmp_path, validation=None))
    held = data.prepare(files_section(tmp_path, validation=0.25))
    assert whole.validation is None
    train_tokens, held_tokens = held.sequences.flatten(), held.validation.flatten()
    # the first 75% of the tokens train, the rest (cut into rows: the tail of each part dropped) validate
    assert torch.equal(train_tokens, whole.sequences.flatten()[: len(train_tokens)])
    assert held.num_tokens == round(0.75 * whole.num_tokens) and len(held.validation) == held_tokens.numel() // 16
    own = data.prepare(files_section(tmp_path, validation=str(tmp_path / "a.txt")))
    assert torch.equal(own.sequences, whole.sequences)
    assert torch.equal(own.validation.flatten()[:16], whole.sequences[0])  # a.txt is the corpus's first document


def test_the_order_is_a_function_of_position_with_a_new_shuffle_each_epoch():
    order = data.SequenceOrder(10, seed=3)
    first_epoch = [order.index(p) for p in range(10)]
    second_epoch = [order.index(p) for p in range(10, 20)]
    assert sorted(first_epoch) == list(range(10)) and sorted(second_epoch) == list(range(10))
    assert first_epoch != second_epoch
    fresh = data.SequenceOrder(10, seed=3)
    assert [fresh.index(p) for p in (13, 2, 17)] == [second_epoch[3], first_epoch[2], second_epoch[7]]
    assert first_epoch != [data.SequenceOrder(10, seed=4).index(p) for p in range(10)]


def test_ranks_split_each_global_batch_without_overlap():
    seqs = torch.arange(40).view(20, 2)
    order = data.SequenceOrder(20, seed=0)
    seen = []
    for rank in range(2):
        batches = data.Batches(seqs, order, global_batch=8, micro_batch=2, rank=rank, world_size=2, pad_id=0,
                               packing=True)
        micro = list(batches.micro_batches(step=1))
        assert len(micro) == 2 and all(ids.shape == (2, 2) for ids, _ in micro)
        seen += [int(ids[i, 0]) // 2 for ids, _ in micro for i in range(2)]
    assert sorted(seen) == sorted(order.index(p) for p in range(8, 16))


def test_padding_is_masked_out_of_the_labels():
    seqs = torch.tensor([[4, 5, 0, 0], [6, 0, 0, 0]])
    batches = data.Batches(seqs, data.SequenceOrder(2, 0), 2, 2, 0, 1, pad_id=0, packing=False)
    (ids, labels), = batches.micro_batches(0)
    assert (labels[ids == 0] == data.IGNORE).all() and (labels[ids != 0] == ids[ids != 0]).all()


@pytest.mark.parametrize("setup, message", [
    (lambda p: DataSection(source="files", files=[str(p / "none*.txt")]), r"matches no file"),
    (lambda p: (p / "x.jsonl").write_text('{"body": "a"}\n') and
     DataSection(source="files", files=[str(p / "x.jsonl")]), r"x.jsonl line 1 has no string field 'text'"),
    (lambda p: (p / "y.jsonl").write_text("{oops\n") and
     DataSection(source="files", files=[str(p / "y.jsonl")]), r"y.jsonl line 1 is not valid JSON"),
    (lambda p: pq.write_table(pa.table({"body": ["a"]}), p / "z.parquet") or
     DataSection(source="files", files=[str(p / "z.parquet")]), r"z.parquet has no column 'text'"),
])
def test_bad_data_files_are_named(tmp_path, setup, message):
    with pytest.raises(ConfigError, match=message):
        data.load_documents(setup(tmp_path))


def test_a_missing_tokenizer_and_a_too_short_corpus_are_named(tmp_path):
    cfg = files_section(tmp_path, tokenizer=str(tmp_path / "tok"))
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*/tok does not exist"):
        data.prepare(cfg)
    with pytest.raises(ConfigError, match=r"shorter than one sequence"):
        data.build_sequences([torch.tensor([1, 2]).numpy()], 8, True, 0)
