"""Training rows read from memory-mapped token shards: a rank reads only the rows it trains on.

A row is seq_len tokens, with its labels (-100 where the loss does not count: padding, tokens a
loss mask leaves out, and, with document masks, each document's first token, whose label would
be predicted from another document) and, with document masks, its position ids, which restart
at 0 at every document so that transformers' attention keeps each document to itself.

- `PackedRows` (plain text, packed): the token stream cut into consecutive rows; a document cut
  at a row's end goes on as a document of its own in the next row.
- `DocumentRows` (unpacked, or chat and prompt/completion data packed): each row holds whole
  documents, a range of them, from an index made once per (seq_len, packing, overlong) and
  memory-mapped like the tokens: unpacked, one document per row; packed, documents in corpus
  order while they fit (a fine-tuning record is never split). A document longer than seq_len is
  truncated (a row of its own) or dropped, as data.overlong says; one truncated to no trained
  token is skipped; each counted.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import torch

from hyperparallel.train.data.shards import locked, read_meta

IGNORE = -100  # the label of a token the loss does not count


class TokenStore:
    """The token shards of one prepared corpus, memory-mapped (nothing is read until asked)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.meta = read_meta(directory)
        dtype = np.dtype(self.meta["dtype"])
        self.sizes = [n for n in self.meta["shards"]]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)
        self._tokens = [np.memmap(directory / f"tokens-{i:05d}.bin", dtype=dtype, mode="r", shape=(n,))
                        for i, n in enumerate(self.sizes)]
        self._trained = ([np.memmap(directory / f"trained-{i:05d}.bin", dtype=np.uint8, mode="r", shape=(n,))
                          for i, n in enumerate(self.sizes)] if self.meta["has_mask"] else None)
        self.ends = np.memmap(directory / "ends.bin", dtype=np.int64, mode="r", shape=(self.meta["documents"],))

    @property
    def num_tokens(self) -> int:
        return int(self.meta["tokens"])

    @property
    def num_documents(self) -> int:
        return int(self.meta["documents"])

    def doc_start(self, doc: int) -> int:
        return int(self.ends[doc - 1]) if doc else 0

    def _read(self, shards: list[np.memmap], start: int, end: int) -> np.ndarray:
        first = int(np.searchsorted(self.starts, start, side="right")) - 1
        parts = []
        while start < end:
            lo = start - int(self.starts[first])
            take = min(end - start, self.sizes[first] - lo)
            parts.append(np.asarray(shards[first][lo: lo + take]))
            start += take
            first += 1
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def tokens(self, start: int, end: int) -> np.ndarray:
        return self._read(self._tokens, start, end)

    def trained(self, start: int, end: int) -> np.ndarray:
        """Which tokens of [start, end) the loss counts (all of them for plain text)."""
        if self._trained is None:
            return np.ones(end - start, dtype=bool)
        return self._read(self._trained, start, end).astype(bool)

    def document_starts(self, start: int, end: int) -> np.ndarray:
        """The documents' first tokens strictly inside (start, end), as indices into the stream."""
        lo = int(np.searchsorted(self.ends, start, side="right"))
        hi = int(np.searchsorted(self.ends, end, side="left"))  # (a document ending at `end` starts none inside)
        return np.asarray(self.ends[lo:hi], dtype=np.int64)


def labels_and_positions(ids: np.ndarray, trained: np.ndarray, starts: np.ndarray, length: int,
                          seq_len: int, document_mask: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """Labels and position ids of a row whose first `length` tokens are real and whose documents
    begin at `starts` (offsets in the row, 0 excluded); the rest is padding."""
    labels = np.where(trained, ids, IGNORE)
    labels[length:] = IGNORE
    if not document_mask:
        return labels, None
    labels[starts] = IGNORE  # (predicted from the end of the document before: not trained)
    positions = np.arange(seq_len, dtype=np.int64)
    for begin in (*starts.tolist(), length):
        if begin < seq_len:
            positions[begin:] -= positions[begin]  # (restart at 0; padding is a segment of its own)
    return labels, positions


class PackedRows:
    """Rows of the token range [lo, hi) of a store, cut consecutively (plain text, packed)."""

    def __init__(self, store: TokenStore, lo: int, hi: int, seq_len: int, document_mask: bool):
        self.store, self.lo, self.hi, self.seq_len, self.document_mask = store, lo, hi, seq_len, document_mask
        self.n = (hi - lo) // seq_len
        self.stats = {"truncated": 0, "dropped": 0, "untrained": 0}

    def __len__(self) -> int:
        return self.n

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        start = self.lo + i * self.seq_len
        end = start + self.seq_len
        ids = self.store.tokens(start, end)
        starts = self.store.document_starts(start, end) - start
        return (ids, *labels_and_positions(ids, self.store.trained(start, end), starts, self.seq_len, self.seq_len,
                                            self.document_mask))


class DocumentRows:
    """Rows of whole documents, from an index of document ranges (see the module's docstring)."""

    def __init__(self, store: TokenStore, index: np.ndarray, stats: dict, seq_len: int, document_mask: bool,
                 pad_id: int):
        self.store, self.index, self.stats = store, index, stats
        self.seq_len, self.document_mask, self.pad_id = seq_len, document_mask, pad_id

    def __len__(self) -> int:
        return len(self.index)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        a, b = (int(v) for v in self.index[i])
        start = self.store.doc_start(a)
        end = min(int(self.store.ends[b - 1]), start + self.seq_len)
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        trained = np.zeros(self.seq_len, dtype=bool)
        ids[: end - start] = self.store.tokens(start, end)
        trained[: end - start] = self.store.trained(start, end)
        starts = np.asarray([self.store.doc_start(d) - start for d in range(a + 1, b)], dtype=np.int64)
        return (ids, *labels_and_positions(ids, trained, starts, end - start, self.seq_len, self.document_mask))


def document_index(store: TokenStore, docs: tuple[int, int], seq_len: int, packing: bool, overlong: str,
                   ) -> tuple[np.ndarray, dict]:
    """The rows of documents [docs[0], docs[1]) as (first, end) document ranges (memory-mapped),
    and what was truncated, dropped or left with no trained token; made once, kept beside the
    shards."""
    name = hashlib.sha256(json.dumps([docs, seq_len, packing, overlong]).encode()).hexdigest()[:12]
    path = store.directory / f"rows-{name}.bin"
    counts_path = path.with_suffix(".json")
    with locked(store.directory / "rows.lock"):
        if not counts_path.is_file():
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            try:
                with open(tmp, "wb") as out:
                    counts = _pack(store, docs, seq_len, packing, overlong, out)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            tmp = counts_path.with_name(f"{counts_path.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps(counts))
            os.replace(tmp, counts_path)  # (last: its presence says the index is whole)
    counts = json.loads(counts_path.read_text())
    rows = counts["rows"]
    index = np.memmap(path, dtype=np.int64, mode="r", shape=(rows, 2)) if rows else np.zeros((0, 2), np.int64)
    return index, {k: v for k, v in counts.items() if k != "rows"}


def _pack(store: TokenStore, docs: tuple[int, int], seq_len: int, packing: bool, overlong: str, out) -> dict:
    """Write the rows (int64 pairs) to `out`, a block of documents at a time (bounded memory)."""
    counts = {"rows": 0, "truncated": 0, "dropped": 0, "untrained": 0}
    row_first, row_tokens = None, 0
    step = 1 << 20
    for block in range(docs[0], docs[1], step):
        rows: list[tuple[int, int]] = []
        last = min(block + step, docs[1])
        ends = np.asarray(store.ends[block:last], dtype=np.int64)
        lengths = np.diff(np.concatenate([[store.doc_start(block)], ends]))
        for doc, length in zip(range(block, last), lengths.tolist(), strict=True):
            if length > seq_len:
                start = store.doc_start(doc)
                skip = "dropped" if overlong == "drop" else (  # (a label at 0 is never a target:)
                    "untrained" if not store.trained(start + 1, start + seq_len).any() else None)
                if skip is not None:
                    counts[skip] += 1
                    if row_first is not None:  # (a row is a range of documents: it ends before this one)
                        rows.append((row_first, doc))
                        row_first = None
                    continue
                counts["truncated"] += 1
            if packing and row_first is not None and row_tokens + length <= seq_len:
                row_tokens += length
                continue
            if row_first is not None:
                rows.append((row_first, doc))
            row_first, row_tokens = doc, length
            if length >= seq_len or not packing:
                rows.append((doc, doc + 1))
                row_first = None
        if last == docs[1] and row_first is not None:
            rows.append((row_first, docs[1]))
        out.write(np.asarray(rows, dtype=np.int64).reshape(-1, 2).tobytes())
        counts["rows"] += len(rows)
    return counts


class TensorRows:
    """Rows already in memory ([N, seq_len] token ids): every token trained but padding (unpacked)."""

    def __init__(self, sequences: torch.Tensor, pad_id: int = 0, packing: bool = True):
        self.sequences, self.pad_id, self.packing = sequences, pad_id, packing
        self.stats = {"truncated": 0, "dropped": 0, "untrained": 0}

    def __len__(self) -> int:
        return len(self.sequences)

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray, None]:
        ids = self.sequences[i].numpy().astype(np.int64)
        labels = ids.copy() if self.packing else np.where(ids == self.pad_id, IGNORE, ids)
        return ids, labels, None
