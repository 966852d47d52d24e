"""A run's data: the corpus tokenized once into shards (`shards`), its rows (`rows`) for training
and validation, and the tokenizer.

`prepare` makes whatever is missing (the builtin tokenizer, the shards, the row indexes) and
opens the rest; `open_prepared` only opens, for the ranks that wait while rank 0 prepares (on a
cluster their cache must be the same storage: a rank that finds nothing says so). Both find a
warm cache from the corpus files' names, sizes and times, without reading the corpus.

Validation (`data.validation`): a held-out fraction of the corpus (its last tokens when plain
text is packed, its last documents otherwise), or files of its own, tokenized alike.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hyperparallel.errors import ConfigError
from hyperparallel.train.config import DataSection
from hyperparallel.train.data import formats, shards
from hyperparallel.train.data.rows import DocumentRows, PackedRows, TokenStore, document_index
from hyperparallel.train.data.shards import EncodeSettings
from hyperparallel.train.data.sources import Source, corpus_sources, files_key, find, records

# the builtin tokenizer learns from at most this much of the corpus's text (more changes little)
TOKENIZER_SAMPLE_CHARS = 8_000_000


def cache_root(cfg: DataSection, run_dir_template: str | None = None) -> Path:
    """Where token shards and the builtin tokenizer live: data.cache_dir; else
    $HYPERPARALLEL_CACHE; else data-cache/ beside the run directory's parent (so the runs of one
    place share it, on the storage they are on); else ~/.cache/hyperparallel."""
    if cfg.cache_dir is not None:
        return Path(cfg.cache_dir).expanduser()
    if os.environ.get("HYPERPARALLEL_CACHE"):
        return Path(os.environ["HYPERPARALLEL_CACHE"])
    if run_dir_template is not None:
        return Path(run_dir_template).expanduser().parent.parent / "data-cache"
    return Path.home() / ".cache" / "hyperparallel"


def input_problems(cfg: DataSection) -> list[str]:
    """What is wrong with the data's files that a look finds (missing, not files, unreadable,
    empty dataset directories), before anything is read in full or written."""
    problems = []
    if cfg.source == "files":
        problems += find(cfg.files, "data.files", cfg.split)[1]
    if isinstance(cfg.validation, list):
        problems += find(cfg.validation, "data.validation", cfg.split)[1]
    if cfg.chat_template is not None and not Path(cfg.chat_template).expanduser().is_file():
        problems.append(f"data.chat_template: {cfg.chat_template} is not a file")
    return problems


def corpus_format(cfg: DataSection, sources: list[Source], key: str) -> str:
    """data.format, or (auto) the first record's: messages -> chat, prompt + completion ->
    prompt_completion, else text."""
    if cfg.format != "auto":
        return cfg.format
    for source in sources:
        if source.kind == "text":  # (a text file is a text record: not read to be told so)
            return "text"
        for _, record in records(source, cfg.text_field, key):
            return formats.detect_format(record)
    return "text"


@dataclass
class Dataset:
    tokenizer: object  # data.tokenizer.Tokenizer
    format: str
    train: PackedRows | DocumentRows
    validation: PackedRows | DocumentRows | None
    num_tokens: int  # of the training part
    # documents, skipped_untrained, truncated, dropped, untrained, reused, prepare_s, tokens_per_s
    stats: dict = field(default_factory=dict)


def _settings(cfg: DataSection, fmt: str) -> EncodeSettings:
    return EncodeSettings(fmt, cfg.text_field, cfg.assistant_only_loss, cfg.completion_only_loss, cfg.max_corpus_bytes)


def _shards(cfg: DataSection, sources: list[Source], fmt: str, tokenizer, cache: Path, key: str, write: bool,
            progress: bool) -> tuple[TokenStore, bool]:
    """The corpus's shards (made if missing and `write`), and whether they were there already."""
    settings = _settings(cfg, fmt)
    directory = cache / f"tokens-{shards.shard_key(files_key(sources), tokenizer.key, settings)}"
    reused = shards.is_complete(directory)
    if not reused:
        if not write:
            raise ConfigError(f"data.cache_dir: {directory} is missing on this rank while rank 0 prepared it: every "
                              f"rank must see the same cache (shared storage) and the same corpus files (their "
                              f"paths, sizes and times key the shards), or run `hyperparallel prepare` on every "
                              f"node first")
        workers = cfg.workers or min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                     else os.cpu_count() or 1)  # (the cores this job may use: cgroups, SLURM)
        shards.write_shards(directory, shards.capped_records(sources, settings, key), tokenizer, settings,
                            workers=workers, progress=progress,
                            description={"key": key, "format": fmt, "tokenizer": tokenizer.key,
                                         "files": [str(s.path) for s in sources[:1000]], "num_files": len(sources)})
    return TokenStore(directory), reused


def _tokenizer(cfg: DataSection, model_path: str | None, sources: list[Source], fmt: str, cache: Path, write: bool):
    from hyperparallel.train.data.tokenizer import load_tokenizer

    settings = _settings(cfg, fmt)

    def sample():  # (the builtin tokenizer's training text: read only when it is not cached)
        if not write:
            raise ConfigError("data.cache_dir: the builtin tokenizer rank 0 trained is missing on this rank: every "
                              "rank must see the same cache (shared storage)")
        budget = TOKENIZER_SAMPLE_CHARS
        for where, record in shards.capped_records(sources, settings, "data.files"):
            if fmt == "text" and record.get(cfg.text_field, "") is None:
                continue
            for text in formats.record_texts(record, fmt, cfg.text_field, where):
                yield text[:budget]
                budget -= min(len(text), budget)
                if budget == 0:
                    return

    corpus = hashlib.sha256(f"{files_key(sources)}/{cfg.max_corpus_bytes}/{fmt}/{cfg.text_field}".encode())
    if not write:
        return load_tokenizer(cfg, model_path, sample, corpus.hexdigest()[:16], cache_dir=cache)
    with shards.locked(cache / "tokenizer.lock"):  # (one trains the builtin tokenizer, the others find it)
        return load_tokenizer(cfg, model_path, sample, corpus.hexdigest()[:16], cache_dir=cache)


def _rows(cfg: DataSection, store: TokenStore, fmt: str, pad_id: int, document_mask: bool,
          docs: tuple[int, int] | None = None, tokens: tuple[int, int] | None = None):
    mask = document_mask and cfg.packing
    if fmt == "text" and cfg.packing:
        lo, hi = tokens or (0, store.num_tokens)
        return PackedRows(store, lo, hi, cfg.seq_len, mask)
    index, counts = document_index(store, docs or (0, store.num_documents), cfg.seq_len, cfg.packing, cfg.overlong)
    return DocumentRows(store, index, counts, cfg.seq_len, mask, pad_id)


def _split(cfg: DataSection, store: TokenStore, fmt: str, pad_id: int, document_mask: bool):
    """(training rows, validation rows, training tokens) of a held-out fraction."""
    fraction = cfg.validation
    if fmt == "text" and cfg.packing:
        n = store.num_tokens
        cut = n - max(cfg.seq_len, round(n * fraction))
        if cut < cfg.seq_len:
            raise ConfigError(f"data.validation: the corpus ({n} tokens) is too short to hold out {fraction} of it and "
                              f"still train on one sequence of {cfg.seq_len}; give validation files, more data, or null")
        return (_rows(cfg, store, fmt, pad_id, document_mask, tokens=(0, cut)),
                _rows(cfg, store, fmt, pad_id, document_mask, tokens=(cut, n)), cut)
    count = store.num_documents
    held = max(1, round(count * fraction))
    if held >= count:
        raise ConfigError(f"data.validation: the corpus has {count} document(s), too few to hold out {fraction} of "
                          f"them; give validation files, more data, or null")
    cut = count - held
    return (_rows(cfg, store, fmt, pad_id, document_mask, docs=(0, cut)),
            _rows(cfg, store, fmt, pad_id, document_mask, docs=(cut, count)), store.doc_start(cut))


def _check_rows(rows, what: str, cfg: DataSection, store: TokenStore) -> None:
    if len(rows) == 0:
        why = (" (data.overlong: drop dropped every record)" if rows.stats["dropped"] else
               " (truncated to seq_len, no record keeps a trained token)" if rows.stats["untrained"] else "")
        raise ConfigError(f"{what}: the corpus ({store.num_tokens} tokens) gives no sequence of data.seq_len = "
                          f"{cfg.seq_len}{why}")


def prepare(cfg: DataSection, *, model_path: str | None = None, cache: Path | None = None,
            document_mask: bool = False, progress: bool = False, write: bool = True) -> Dataset:
    """The run's data, made where missing (see the module's docstring); `document_mask`: packed
    rows restart positions at each document (the trainer decides it from data.document_mask and
    what the layout supports)."""
    start = time.perf_counter()
    cache = cache or cache_root(cfg)
    sources = corpus_sources(cfg.files if cfg.source == "files" else None, cfg.source, "data.files", cfg.split)
    extra = (corpus_sources(cfg.validation, "files", "data.validation", cfg.split)
             if isinstance(cfg.validation, list) else None)
    fmt = corpus_format(cfg, sources, "data.files")
    tokenizer = _tokenizer(cfg, model_path, sources, fmt, cache, write)
    store, reused = _shards(cfg, sources, fmt, tokenizer, cache, "data.files", write, progress)
    validation = None
    if isinstance(cfg.validation, float):
        train, validation, num_tokens = _split(cfg, store, fmt, tokenizer.pad_id, document_mask)
        _check_rows(validation, "data.validation", cfg, store)
    else:
        train, num_tokens = _rows(cfg, store, fmt, tokenizer.pad_id, document_mask), store.num_tokens
        if extra is not None:
            held, _ = _shards(cfg, extra, fmt, tokenizer, cache, "data.validation", write, progress)
            validation = _rows(cfg, held, fmt, tokenizer.pad_id, document_mask)
            _check_rows(validation, "data.validation", cfg, held)
    _check_rows(train, "data", cfg, store)
    meta = store.meta
    stats = {"documents": meta["documents"], "skipped_untrained": meta["skipped_untrained"], **train.stats,
             "reused": reused, "prepare_s": round(time.perf_counter() - start, 3),
             "tokenize_s": meta["seconds"], "tokens_per_s": meta["tokens_per_s"], "shards": str(store.directory)}
    return Dataset(tokenizer, fmt, train, validation, num_tokens, stats)


def open_prepared(cfg: DataSection, **kwargs) -> Dataset:
    """The run's data as `prepare` made it, writing nothing (a ConfigError where it is missing)."""
    return prepare(cfg, write=False, **kwargs)


def describe(dataset: Dataset, d: DataSection, no_mask_reason: str | None = None) -> str:
    """What the data is and what became of its records: the format and its loss mask, packing,
    the shards (made now, at what rate, or found), what was skipped, truncated or dropped."""
    s = dataset.stats
    what = {"text": "plain text", "chat": "chat" + (", the assistant turns trained" if d.assistant_only_loss else ""),
            "prompt_completion": "prompt/completion" + (", the completions trained" if d.completion_only_loss else "")}
    layout = "one per row"
    if d.packing:
        layout = ("packed, document masks" if dataset.train.document_mask else
                  f"packed, no document masks ({no_mask_reason})" if no_mask_reason else "packed")
    made = (f"found in {s['shards']}" if s["reused"] else
            f"tokenized into {s['shards']} at {s['tokens_per_s']:,} tokens/s")
    counts = [f"{s[k]:,} {label}" for k, label in (("skipped_untrained", "skipped (no trained token)"),
                                                   ("truncated", "truncated"), ("dropped", "dropped"),
                                                   ("untrained", "skipped (no trained token within seq_len)"))
              if s.get(k)]
    return (f"data: {s['documents']:,} documents, {what[dataset.format]}, {layout}; shards {made}"
            + (f"; records: {', '.join(counts)}" if counts else ""))
