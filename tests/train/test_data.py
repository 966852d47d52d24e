"""Corpus sources, token shards, rows (packing, document masks, fine-tuning records) and the
resumable order of sequences."""

from __future__ import annotations

import json
import threading

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from hyperparallel.errors import ConfigError
from hyperparallel.train import data
from hyperparallel.train.config import DataSection
from hyperparallel.train.data import shards, sources

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPERPARALLEL_CACHE", str(tmp_path / "cache"))


def files_section(tmp_path, **kw) -> DataSection:
    if not (tmp_path / "a.txt").is_file():  # (written once: a file's time is part of the cache's key)
        (tmp_path / "a.txt").write_text(TEXT)
        (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": TEXT[i:]}) for i in range(0, 60, 20)) + "\n")
        pq.write_table(pa.table({"text": [TEXT, TEXT.upper()]}), tmp_path / "c.parquet")
    kw = {"workers": 1, "seq_len": 16, "vocab_size": 300, **kw}
    return DataSection(source="files", files=[str(tmp_path / "*.txt"), str(tmp_path / "b.jsonl"),
                                              str(tmp_path / "c.parquet")], **kw)


def corpus_texts(cfg: DataSection) -> list[str]:
    found = sources.corpus_sources(cfg.files if cfg.source == "files" else None, cfg.source, "data.files", cfg.split)
    settings = shards.EncodeSettings("text", cfg.text_field, True, True, cfg.max_corpus_bytes)
    return [r[cfg.text_field] for _, r in shards.capped_records(found, settings, "data.files")]


def all_rows(rows) -> list[tuple]:
    return [rows.row(i) for i in range(len(rows))]


def test_text_jsonl_and_parquet_files_make_one_corpus(tmp_path):
    texts = corpus_texts(files_section(tmp_path))
    assert len(texts) == 1 + 3 + 2 and texts[0] == TEXT and texts[-1] == TEXT.upper()
    dataset = data.prepare(files_section(tmp_path, validation=None))
    assert dataset.stats["documents"] == 6 and dataset.format == "text"
    tok = dataset.tokenizer
    first = dataset.train.store.tokens(0, dataset.train.store.doc_start(1))
    assert first.tolist() == [*tok.encode(TEXT, add_special_tokens=True)[0], tok.eos_id]


def test_save_to_disk_and_dataset_repository_directories_are_read_as_their_records(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = [{"text": TEXT[i:], "n": i} for i in range(0, 90, 30)]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:2]),
                          "test": datasets.Dataset.from_list(rows[2:])}).save_to_disk(str(tmp_path / "splits"))
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": [r["text"] for r in rows]}), tmp_path / "repo" / "data" / "train-0.parquet")
    for name, split, expected in (("saved", "train", rows), ("splits", "test", rows[2:]), ("repo", "train", rows)):
        cfg = DataSection(source="files", files=[str(tmp_path / name)], split=split)
        assert corpus_texts(cfg) == [r["text"] for r in expected], name
    with pytest.raises(ConfigError, match=r"splits is a DatasetDict with splits \['train', 'test'\], not 'dev'"):
        corpus_texts(DataSection(source="files", files=[str(tmp_path / "splits")], split="dev"))


def test_the_stdlib_corpus_is_capped_and_fixed():
    cfg = DataSection(max_corpus_bytes=50_000)
    texts = corpus_texts(cfg)
    assert sum(map(len, texts)) == 50_000 and corpus_texts(cfg) == texts
    found = sources.corpus_sources(None, "stdlib", "data.files", "train")
    assert not any("site-packages" in str(s.path) for s in found)


def test_shards_and_tokenizer_are_made_once_then_found_without_reading_the_corpus(tmp_path, monkeypatch):
    first = data.prepare(files_section(tmp_path))
    cache = tmp_path / "cache"
    assert len(list(cache.glob("tokenizer-*"))) == 1 and first.tokenizer.vocab_size <= 300
    assert not first.stats["reused"]
    made = [p.stat().st_mtime_ns for p in sorted(cache.glob("tokens-*/*.bin"))]

    def no_reading(*args, **kwargs):
        raise AssertionError("a warm cache reads no record")

    monkeypatch.setattr(shards, "capped_records", no_reading)
    again = data.prepare(files_section(tmp_path, format="text"))
    assert again.stats["reused"] and [p.stat().st_mtime_ns for p in sorted(cache.glob("tokens-*/*.bin"))] == made
    assert [r[0].tolist() for r in all_rows(again.train)] == [r[0].tolist() for r in all_rows(first.train)]
    (tmp_path / "a.txt").write_text(TEXT + "# changed\n")  # (a file's size or time changes its key)
    monkeypatch.undo()
    assert not data.prepare(files_section(tmp_path)).stats["reused"]


def test_worker_processes_write_the_same_shards_as_one_process(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "CHUNK_CHARS", 2000)  # (many chunks, in flight at once: their order is kept)
    one = data.prepare(files_section(tmp_path, validation=None))
    store = one.train.store
    cfg = files_section(tmp_path, validation=None, workers=2)
    settings = shards.EncodeSettings("text", "text", True, True, None)
    found = sources.corpus_sources(cfg.files, "files", "data.files", "train")
    meta = shards.write_shards(tmp_path / "two", shards.capped_records(found, settings, "k"), one.tokenizer, settings,
                               workers=2, description={}, progress=False)
    two = data.TokenStore(tmp_path / "two")
    assert meta["workers"] == 2 and two.num_tokens == store.num_tokens
    assert np.array_equal(two.tokens(0, two.num_tokens), store.tokens(0, store.num_tokens))
    assert np.array_equal(np.asarray(two.ends), np.asarray(store.ends))


def test_concurrent_writers_make_one_copy(tmp_path):
    cfg = files_section(tmp_path, validation=None)
    results, errors = [], []

    def run():
        try:
            results.append(data.prepare(cfg))
        except Exception as error:  # (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 3
    assert len([p for p in (tmp_path / "cache").glob("tokens-*") if p.is_dir()]) == 1
    assert len(list((tmp_path / "cache").glob("tokenizer-*.json"))) == 1


def test_shards_roll_over_and_rows_read_across_them(tmp_path, monkeypatch):
    monkeypatch.setattr(shards, "SHARD_TOKENS", 100)
    dataset = data.prepare(files_section(tmp_path, validation=None))
    store = dataset.train.store
    assert len(store.meta["shards"]) > 2 and max(store.meta["shards"]) == 100
    monkeypatch.undo()
    whole = data.prepare(files_section(tmp_path, validation=None, cache_dir=str(tmp_path / "other")))
    assert np.array_equal(store.tokens(90, 230), whole.train.store.tokens(90, 230))


def test_packed_rows_restart_positions_at_each_document_and_do_not_train_across(tmp_path):
    cfg = files_section(tmp_path, validation=None)
    plain = data.prepare(cfg)
    masked = data.prepare(cfg, document_mask=True)
    store = masked.train.store
    ends = np.asarray(store.ends)
    for i in range(len(masked.train)):
        ids, labels, positions = masked.train.row(i)
        same_ids, same_labels, none = plain.train.row(i)
        assert none is None and np.array_equal(ids, same_ids) and np.array_equal(same_labels, ids)
        starts = [int(e) - 16 * i for e in ends if 16 * i < e < 16 * (i + 1)]
        expected = np.arange(16)
        for s in starts:
            expected[s:] -= expected[s]
        assert np.array_equal(positions, expected)
        assert (labels[starts] == data.IGNORE).all() and np.array_equal(np.delete(labels, starts),
                                                                         np.delete(ids, starts))


def test_a_document_starting_at_a_rows_last_token_restarts_there(tmp_path):
    """Documents of 7, 5, 4 and 8 tokens in rows of 8: boundaries at a row's last position (7) and
    at a row's end (16, the next row's first: no restart inside)."""
    directory = tmp_path / "store"
    directory.mkdir()
    lengths = [7, 5, 4, 8]
    (directory / "tokens-00000.bin").write_bytes(np.arange(1, 25, dtype=np.uint16).tobytes())
    (directory / "ends.bin").write_bytes(np.cumsum(lengths).astype(np.int64).tobytes())
    (directory / "meta.json").write_text(json.dumps({"dtype": "uint16", "tokens": 24, "documents": 4,
                                                     "shards": [24], "has_mask": False}))
    rows = data.PackedRows(data.TokenStore(directory), 0, 24, 8, document_mask=True)
    ids, labels, positions = rows.row(0)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 0] and labels[7] == data.IGNORE
    ids, labels, positions = rows.row(1)  # tokens 8..15: the second document from its 2nd token, the third from 12
    assert positions.tolist() == [0, 1, 2, 3, 0, 1, 2, 3] and labels.tolist() == [9, 10, 11, 12, data.IGNORE, 14, 15, 16]
    assert rows.row(2)[2].tolist() == list(range(8))


def test_unpacked_rows_are_one_document_each_padded_and_overlong_ones_truncated_or_dropped(tmp_path):
    truncated = data.prepare(files_section(tmp_path, packing=False, validation=None))
    pad = truncated.tokenizer.pad_id
    assert len(truncated.train) == 6 and truncated.train.stats["truncated"] == 6  # (every document > 16 tokens)
    ids, labels, positions = truncated.train.row(0)
    assert positions is None and np.array_equal(ids, truncated.train.store.tokens(0, 16))
    (tmp_path / "short.jsonl").write_text(json.dumps({"text": "x = 1"}) + "\n")
    short = data.prepare(DataSection(source="files", files=[str(tmp_path / "short.jsonl")], vocab_size=300,
                                     seq_len=16, packing=False, validation=None, workers=1, max_corpus_bytes=None))
    ids, labels, _ = short.train.row(0)
    n = short.train.store.num_tokens
    assert (ids[n:] == short.tokenizer.pad_id).all() and (labels[n:] == data.IGNORE).all() and pad is not None
    with pytest.raises(ConfigError, match=r"overlong: drop dropped every record"):
        data.prepare(files_section(tmp_path, packing=False, validation=None, overlong="drop"))


def chat_records(n: int) -> list[dict]:
    """Conversations of several lengths; every fourth has no assistant turn (nothing to train)."""
    return [{"messages": [{"role": "user", "content": f"say {i}"}]
             + ([{"role": "assistant", "content": "ok " * (i % 4)}] if i % 4 else [])} for i in range(n)]


def test_packed_fine_tuning_rows_hold_whole_records_with_their_loss_masks(tmp_path):
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chat_records(12)))
    cfg = DataSection(source="files", files=[str(tmp_path / "chat.jsonl")], vocab_size=300, seq_len=64,
                      validation=None, workers=1)
    dataset = data.prepare(cfg, document_mask=True)
    store, rows = dataset.train.store, dataset.train
    assert dataset.format == "chat" and store.meta["has_mask"] and dataset.stats["skipped_untrained"] == 3
    covered = []
    for i, (a, b) in enumerate(np.asarray(rows.index).tolist()):
        covered += list(range(a, b))
        start = store.doc_start(a)
        length = int(store.ends[b - 1]) - start
        assert length <= 64
        ids, labels, positions = rows.row(i)
        firsts = [store.doc_start(d) - start for d in range(a + 1, b)]
        expect = np.where(store.trained(start, start + length), ids[:length], data.IGNORE)
        expect[firsts] = data.IGNORE
        assert np.array_equal(ids[:length], store.tokens(start, start + length))
        assert np.array_equal(labels[:length], expect) and (labels[length:] == data.IGNORE).all()
        assert positions[0] == 0 and all(positions[f] == 0 for f in firsts) and (length == 64 or positions[length] == 0)
    assert covered == list(range(store.num_documents)) and len(rows) < store.num_documents


def test_records_with_nothing_to_predict_are_skipped_and_an_empty_validation_is_named(tmp_path):
    records = [{"prompt": "", "completion": ""}] + [{"prompt": f"say {i}", "completion": " ok"} for i in range(20)]
    records.append({"prompt": "long " * 200, "completion": " ok"})  # (the last: the one held out)
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = DataSection(source="files", files=[str(tmp_path / "pc.jsonl")], vocab_size=300, seq_len=32, workers=1,
                      validation=None)
    dataset = data.prepare(cfg)
    assert dataset.format == "prompt_completion" and dataset.stats["skipped_untrained"] == 1
    with pytest.raises(ConfigError, match=r"data.validation: .*gives no sequence .*overlong: drop dropped"):
        data.prepare(cfg.model_copy(update={"validation": 0.05, "overlong": "drop"}))


def test_validation_holds_out_the_end_of_the_corpus_or_reads_files_of_its_own(tmp_path):
    whole = data.prepare(files_section(tmp_path, validation=None))
    held = data.prepare(files_section(tmp_path, validation=0.25))
    assert whole.validation is None
    n = whole.train.store.num_tokens
    # the first 75% of the tokens train, the rest (cut into rows: the tail of each part dropped) validate
    assert held.num_tokens == round(0.75 * n) and len(held.train) == held.num_tokens // 16
    assert len(held.validation) == (n - held.num_tokens) // 16 and held.validation.lo == held.num_tokens
    own = data.prepare(files_section(tmp_path, validation=str(tmp_path / "a.txt")))
    assert len(own.train) == len(whole.train)
    assert np.array_equal(own.validation.row(0)[0], whole.train.row(0)[0])  # a.txt is the corpus's first document
    unpacked = data.prepare(files_section(tmp_path, packing=False))
    assert len(unpacked.train) == 5 and len(unpacked.validation) == 1  # the last document held out


def test_the_order_is_a_function_of_position_with_a_new_shuffle_each_epoch():
    order = data.SequenceOrder(10, seed=3)
    first_epoch = [order.index(p) for p in range(10)]
    second_epoch = [order.index(p) for p in range(10, 20)]
    assert sorted(first_epoch) == list(range(10)) and sorted(second_epoch) == list(range(10))
    assert first_epoch != second_epoch
    fresh = data.SequenceOrder(10, seed=3)
    assert [fresh.index(p) for p in (13, 2, 17)] == [second_epoch[3], first_epoch[2], second_epoch[7]]
    assert first_epoch != [data.SequenceOrder(10, seed=4).index(p) for p in range(10)]


@pytest.mark.parametrize("n", [1, 2, 3, 97, 1000, 4099])
def test_the_keyed_permutation_is_a_bijection_without_a_table(n):
    from hyperparallel.train.data.batches import KeyedPermutation

    perm = KeyedPermutation(n, key=12345)
    assert sorted(perm(i) for i in range(n)) == list(range(n))
    if n > 97:  # (shuffled: few fixed points, and not mostly in order)
        assert sum(perm(i) == i for i in range(n)) < n // 50 + 3


def test_ranks_split_each_global_batch_without_overlap():
    rows = data.TensorRows(torch.arange(40).view(20, 2))
    order = data.SequenceOrder(20, seed=0)
    seen = []
    for rank in range(2):
        batches = data.Batches(rows, order, global_batch=8, micro_batch=2, rank=rank, world_size=2)
        micro = list(batches.micro_batches(step=1))
        assert len(micro) == 2 and all(m.ids.shape == (2, 2) and m.positions is None for m in micro)
        seen += [int(m.ids[i, 0]) // 2 for m in micro for i in range(2)]
    assert sorted(seen) == sorted(order.index(p) for p in range(8, 16))


def test_padding_is_masked_out_of_the_labels():
    rows = data.TensorRows(torch.tensor([[4, 5, 0, 0], [6, 0, 0, 0]]), pad_id=0, packing=False)
    micro, = data.Batches(rows, data.SequenceOrder(2, 0), 2, 2, 0, 1).micro_batches(0)
    ids, labels = micro.ids, micro.labels
    assert (labels[ids == 0] == data.IGNORE).all() and (labels[ids != 0] == ids[ids != 0]).all()


@pytest.mark.parametrize("setup, message", [
    (lambda p: DataSection(source="files", files=[str(p / "none*.txt")]), r"matches no file"),
    (lambda p: (p / "x.jsonl").write_text('{"body": "a"}\n') and
     DataSection(source="files", files=[str(p / "x.jsonl")], format="text"), r"x.jsonl line 1 has no string field 'text'"),
    (lambda p: (p / "y.jsonl").write_text("{oops\n") and
     DataSection(source="files", files=[str(p / "y.jsonl")]), r"y.jsonl line 1 is not valid JSON"),
    (lambda p: pq.write_table(pa.table({"body": ["a"]}), p / "z.parquet") or
     DataSection(source="files", files=[str(p / "z.parquet")], format="text"), r"z.parquet row 0 has no string field 'text'"),
    (lambda p: (p / "w.arrow").write_bytes(b"not arrow") and
     DataSection(source="files", files=[str(p / "w.arrow")]), r"w.arrow is not a readable Arrow file"),
])
def test_bad_data_files_are_named(tmp_path, setup, message):
    with pytest.raises(ConfigError, match=message):
        data.prepare(setup(tmp_path))
    assert not list((tmp_path / "cache").glob("tokens-*"))  # (nothing half-written is left)


def test_a_missing_tokenizer_and_a_too_short_corpus_are_named(tmp_path):
    cfg = files_section(tmp_path, tokenizer=str(tmp_path / "tok"))
    with pytest.raises(ConfigError, match=r"data.tokenizer: .*tok"):
        data.prepare(cfg)
    with pytest.raises(ConfigError, match=r"gives no sequence of data.seq_len = 100000"):
        data.prepare(files_section(tmp_path, seq_len=100_000, validation=None))
