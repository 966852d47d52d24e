"""Tokenizing a corpus once, into token shards on disk that every rank memory-maps.

A streaming pass: the records are read a bounded piece at a time (`sources`), encoded by worker
processes (`formats.encode_record`: token ids and which of them the loss counts) a chunk at a
time with at most two chunks per worker in flight, and appended, in corpus order, to

    DIR/tokens-00000.bin ...   token ids (uint16 when the vocabulary fits, else uint32), rolled
                               every SHARD_TOKENS tokens
    DIR/trained-00000.bin ...  one byte per token, 1 where the loss counts it (chat and
                               prompt/completion data only: plain text trains on every token)
    DIR/ends.bin               int64: each document's end (an index into the whole token stream)
    DIR/meta.json              what it holds; written last, so a directory with one is complete

The pass writes into a temporary directory renamed into place at the end, under a file lock, so
concurrent writers (ranks, jobs, `hyperparallel prepare`) make one copy and a reader never sees
half of one. The directory's name is a key of everything that decides its content: the corpus's
files (paths, sizes, times), the tokenizer, the format and its loss-mask settings.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hyperparallel.errors import ConfigError
from hyperparallel.train.data import formats
from hyperparallel.train.data.sources import Source, fields_of, records

VERSION = 1  # of the layout: a change makes new keys, never a misread of old directories
SHARD_TOKENS = 1 << 28  # tokens per shard file (512 MiB of uint16)
CHUNK_CHARS = 1 << 20  # text of one chunk a worker encodes (bounded memory, enough work per message)


@dataclass(frozen=True)
class EncodeSettings:
    """How records become tokens: every field is part of the shards' key."""

    format: str  # text | chat | prompt_completion
    text_field: str
    assistant_only_loss: bool
    completion_only_loss: bool
    max_corpus_bytes: int | None

    @property
    def has_mask(self) -> bool:
        return self.format != "text"


def shard_key(files_key: str, tokenizer_key: str, settings: EncodeSettings) -> str:
    fields = dict(settings.__dict__)
    if settings.format == "text":  # (the loss-mask settings change nothing of plain text's shards)
        fields.pop("assistant_only_loss"), fields.pop("completion_only_loss")
    text = json.dumps([VERSION, files_key, tokenizer_key, fields], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def is_complete(directory: Path) -> bool:
    return (directory / "meta.json").is_file()


def read_meta(directory: Path) -> dict:
    return json.loads((directory / "meta.json").read_text())


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (a file beside what it guards), held for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX)
        except OSError as error:  # (Lustre without -o flock, some FUSE mounts)
            raise ConfigError(f"data.cache_dir: {path.parent} cannot be locked ({os.strerror(error.errno)}): put the "
                              f"cache on a file system with flock, or run `hyperparallel prepare` once before "
                              f"training") from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# ------------------------------------------------------------------------------- the reader


def record_size(record: dict, fmt: str, text_field: str) -> int:
    """A record's text, in characters: what data.max_corpus_bytes counts (0 for a malformed one,
    which its encoding names)."""
    if fmt == "text":
        text = record.get(text_field)
        return len(text) if isinstance(text, str) else 0
    size = 0
    for value in (record.get("messages"), record.get("prompt"), record.get("completion")):
        if isinstance(value, str):
            size += len(value)
        elif isinstance(value, list):
            size += sum(len(m["content"]) for m in value if isinstance(m, dict) and isinstance(m.get("content"), str))
    return size


def capped_records(sources: list[Source], settings: EncodeSettings, key: str) -> Iterator[tuple[str, dict]]:
    """The corpus's records in order, up to data.max_corpus_bytes of text (the text that crosses
    the cap cut there; a record of another format ends the corpus before it instead)."""
    budget = settings.max_corpus_bytes
    for source in sources:
        for where, record in records(source, settings.text_field, key, fields_of(settings.format, settings.text_field)):
            if budget is None:
                yield where, record
                continue
            size = record_size(record, settings.format, settings.text_field)
            if size > budget:
                if settings.format == "text" and budget > 0:
                    yield where, {**record, settings.text_field: record[settings.text_field][:budget]}
                return
            budget -= size
            yield where, record


def chunks(items: Iterable[tuple[str, dict]], settings: EncodeSettings) -> Iterator[list[tuple[str, dict]]]:
    chunk, chars = [], 0
    for item in items:
        chunk.append(item)
        chars += record_size(item[1], settings.format, settings.text_field) + 64
        if chars >= CHUNK_CHARS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


# ------------------------------------------------------------------------------- the workers

_worker: dict = {}


def _start_worker(tokenizer, settings: EncodeSettings) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (Ctrl-C reaches the parent, which stops them: one message)
    _worker.update(tokenizer=tokenizer, settings=settings)


def encode_chunk(chunk: list[tuple[str, dict]], tokenizer=None, settings: EncodeSettings | None = None):
    """(ids uint32, trained uint8 or None, lengths int64, skipped) of a chunk's records; a record
    with no trained token is skipped (and counted)."""
    tokenizer = tokenizer or _worker["tokenizer"]
    settings = settings or _worker["settings"]
    if settings.format == "text":
        return _encode_texts(chunk, tokenizer, settings.text_field)
    ids, trained, lengths, skipped = [], [], [], 0
    for where, record in chunk:
        tokens, mask = formats.encode_record(
            record, settings.format, tokenizer, text_field=settings.text_field,
            assistant_only_loss=settings.assistant_only_loss, completion_only_loss=settings.completion_only_loss,
            where=where)
        if not mask[1:].any():  # (the first token is never a target: it has nothing before it)
            skipped += 1
            continue
        ids.append(np.asarray(tokens, dtype=np.uint32))
        trained.append(np.asarray(mask, dtype=np.uint8))
        lengths.append(len(tokens))
    flat = np.concatenate(ids) if ids else np.zeros(0, np.uint32)
    mask = (np.concatenate(trained) if trained else np.zeros(0, np.uint8)) if settings.has_mask else None
    return flat, mask, np.asarray(lengths, dtype=np.int64), skipped


def _encode_texts(chunk: list[tuple[str, dict]], tokenizer, text_field: str):
    """encode_chunk of plain text: the texts encoded as one batch (the tokenizer's own threads
    share it in a single process), each as formats.encode_record encodes it: ids, then EOS."""
    texts = []
    skipped = 0
    for where, record in chunk:
        if record.get(text_field, "") is None:
            skipped += 1  # (a null text: a table's missing value)
            continue
        formats.record_texts(record, "text", text_field, where)  # (a record without the field: named)
        texts.append(record[text_field])
    # (ids only: offsets, which plain text does not need, cost as much again to hand over)
    encoded = [e.ids for e in tokenizer.backend.encode_batch_fast(texts, add_special_tokens=True)] if texts else []
    parts = [np.asarray([*ids, tokenizer.eos_id], dtype=np.uint32) for ids in encoded]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.uint32)
    return flat, None, np.asarray([len(p) for p in parts], dtype=np.int64), skipped


def _start_method() -> str:
    """fork on Linux (as torch's DataLoader and `datasets` fork theirs: the workers run no torch,
    only the tokenizer and JSON, and spawned children would import the user's __main__ again);
    spawn elsewhere (macOS's system libraries do not survive a fork)."""
    return "fork" if sys.platform.startswith("linux") else "spawn"


@contextlib.contextmanager
def _pool(workers: int, tokenizer, settings: EncodeSettings):
    """`workers` processes. TOKENIZERS_PARALLELISM is set while they start: they then run one
    thread each, without the tokenizer's warning about threads it used before a fork."""
    from concurrent.futures import ProcessPoolExecutor

    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context(_start_method()),
                                   initializer=_start_worker, initargs=(tokenizer, settings))
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before
    with pool:
        yield pool


def _encoded(batches: Iterator[list], tokenizer, settings: EncodeSettings, workers: int) -> Iterator[tuple]:
    """encode_chunk over the chunks in order: in this process with one worker, else in `workers`
    processes with at most 2 x workers chunks in flight (memory stays bounded)."""
    from concurrent.futures.process import BrokenProcessPool

    if workers <= 1:
        for chunk in batches:
            yield encode_chunk(chunk, tokenizer, settings)
        return
    try:
        with _pool(workers, tokenizer, settings) as pool:
            pending: deque = deque()
            for chunk in batches:
                pending.append(pool.submit(encode_chunk, chunk))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
    except BrokenProcessPool:
        raise ConfigError(f"data.workers: a tokenizing process died (out of memory?); lower data.workers "
                          f"(it was {workers})") from None


# ------------------------------------------------------------------------------- the writer


class _ShardWriter:
    def __init__(self, directory: Path, dtype: np.dtype, has_mask: bool):
        self.directory, self.dtype, self.has_mask = directory, dtype, has_mask
        self.shards: list[int] = []  # tokens per shard
        self.tokens = 0
        self.documents = 0
        self.ends = open(directory / "ends.bin", "wb")
        self._files: tuple = ()

    def _roll(self) -> None:
        for f in self._files:
            f.close()
        n = len(self.shards)
        self._files = (open(self.directory / f"tokens-{n:05d}.bin", "wb"),
                       *([open(self.directory / f"trained-{n:05d}.bin", "wb")] if self.has_mask else []))
        self.shards.append(0)

    def write(self, ids: np.ndarray, mask: np.ndarray | None, lengths: np.ndarray) -> None:
        self.ends.write((self.tokens + np.cumsum(lengths)).astype(np.int64).tobytes())
        self.documents += len(lengths)
        at = 0
        while at < len(ids):
            if not self.shards or self.shards[-1] == SHARD_TOKENS:
                self._roll()
            take = min(len(ids) - at, SHARD_TOKENS - self.shards[-1])
            self._files[0].write(ids[at: at + take].astype(self.dtype).tobytes())
            if mask is not None:
                self._files[1].write(mask[at: at + take].tobytes())
            self.shards[-1] += take
            self.tokens += take
            at += take

    def close(self) -> None:
        for f in (*self._files, self.ends):
            f.close()


def _progress(enabled: bool):
    """A progress line on stderr (rich, on a terminal): tokens so far and tokens/s."""
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    console = Console(file=sys.stderr)
    if not console.is_terminal:
        return None
    return Progress(SpinnerColumn(), TextColumn("[bold]tokenizing"), TextColumn("{task.description}"),
                    TimeElapsedColumn(), console=console, transient=True)


def write_shards(directory: Path, items: Iterable[tuple[str, dict]], tokenizer, settings: EncodeSettings, *,
                 workers: int, description: dict, progress: bool = True) -> dict:
    """Tokenize `items` into `directory` (see the module's docstring), unless a complete copy is
    already there; its meta either way."""
    with locked(directory.with_name(directory.name + ".lock")):
        if is_complete(directory):  # (another writer finished it while this one waited)
            return read_meta(directory)
        # a writer of this machine that died: none runs now (where flock is per machine, as on NFS
        # with local_lock, another machine's writer may, so its directories are left alone)
        host = socket.gethostname()
        for stale in directory.parent.glob(f"{directory.name}.tmp-{host}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = directory.with_name(f"{directory.name}.tmp-{host}-{os.getpid()}")
        tmp.mkdir(parents=True)
        # (by the largest id, not the count: a vocabulary's ids may leave gaps)
        dtype = np.dtype(np.uint16 if max(tokenizer.backend.get_vocab().values()) < 1 << 16 else np.uint32)
        writer = _ShardWriter(tmp, dtype, settings.has_mask)
        skipped, start = 0, time.perf_counter()
        bar = _progress(progress)
        try:
            with bar if bar is not None else contextlib.nullcontext():
                task = bar.add_task("", total=None) if bar is not None else None
                for ids, mask, lengths, dropped in _encoded(chunks(items, settings), tokenizer, settings, workers):
                    writer.write(ids, mask, lengths)
                    skipped += dropped
                    if bar is not None:
                        rate = writer.tokens / max(time.perf_counter() - start, 1e-9)
                        bar.update(task, description=f"{writer.tokens:,} tokens, {rate:,.0f} tokens/s")
            writer.close()
        except BaseException:
            writer.close()
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if writer.documents == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            what = "the corpus is empty" if not skipped else f"none of its {skipped} record(s) has a trained token"
            raise ConfigError(f"{description.get('key', 'data')}: {what}")
        seconds = time.perf_counter() - start
        meta = {"version": VERSION, "dtype": dtype.name, "tokens": writer.tokens, "documents": writer.documents,
                "shards": writer.shards, "has_mask": settings.has_mask, "skipped_untrained": skipped,
                "seconds": round(seconds, 3), "tokens_per_s": round(writer.tokens / max(seconds, 1e-9)),
                "workers": workers, **description}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, directory)  # (under the lock only complete directories exist: it is absent)
        except OSError:
            if not is_complete(directory):  # (else another machine's writer finished the same one first)
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            return read_meta(directory)
        return meta
