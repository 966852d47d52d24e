"""Training data: a corpus, a tokenizer, and a deterministic, resumable order of sequences.

The default corpus is this Python's own standard library sources, which exist on every machine
with Python; the default ("builtin") tokenizer is a byte-level BPE trained on that corpus in a
few seconds. Both are cached under ~/.cache/hyperparallel (HYPERPARALLEL_CACHE) keyed by what
made them, so later runs start at once.

Validation (`data.validation`): a held-out fraction of the corpus (its last tokens when packed,
its last documents when not), or files of its own; the tokenizer is trained on the whole corpus.

Order: the sequences are shuffled once per epoch by a generator seeded with (seed, epoch). The
sequence at global position p is therefore a pure function of p, and a run resumes exactly by
starting at position step x global_batch.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hyperparallel.errors import ConfigError
from hyperparallel.train.config import DataSection

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IGNORE = -100  # label of padding: no loss


def cache_root() -> Path:
    return Path(os.environ.get("HYPERPARALLEL_CACHE", Path.home() / ".cache" / "hyperparallel"))


def cache_dir() -> Path:
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    return root


def _atomic_write_bytes(path: Path, payload: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(payload)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------ corpus


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # tests hold deliberately odd encodings and generated data; the library itself is plain code
    return sorted(p for p in root.rglob("*.py") if "test" not in p.relative_to(root).parts[0])


def _expand(patterns: list[str], key: str = "data.files") -> list[Path]:
    files, problems = _matches(patterns, key)
    if problems:
        raise ConfigError("\n".join(problems))
    return files


def _matches(patterns: list[str], key: str) -> tuple[list[Path], list[str]]:
    files: list[Path] = []
    problems = []
    for pattern in patterns:
        matches = sorted(glob.glob(os.path.expanduser(pattern), recursive=True))
        if not matches:
            problems.append(f"{key}: {pattern!r} matches no file")
        for match in matches:
            if not Path(match).is_file():
                problems.append(f"{key}: {match} is not a file")
            elif not os.access(match, os.R_OK):
                problems.append(f"{key}: {match} is not readable")
            else:
                files.append(Path(match))
    return files, problems


def input_problems(cfg: DataSection) -> list[str]:
    """What is wrong with the data's files that a look finds (missing, not files, unreadable),
    before anything is read in full or written. (The tokenizer file: `tokenizer_vocab_size`.)"""
    problems = []
    if cfg.source == "files":
        problems += _matches(cfg.files, "data.files")[1]
    if isinstance(cfg.validation, list):
        problems += _matches(cfg.validation, "data.validation")[1]
    return problems


def tokenizer_vocab_size(cfg: DataSection) -> int:
    """The tokenizer's vocabulary as a run will have it, without training one: data.vocab_size for
    the builtin tokenizer (the most it trains to), the file's otherwise (read and parsed: a
    ConfigError when it does not parse)."""
    return cfg.vocab_size if cfg.tokenizer == "builtin" else read_tokenizer_file(cfg).vocab_size


def _documents_of(path: Path, text_field: str, key: str) -> list[str]:
    if path.suffix == ".jsonl":
        docs = []
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{key}: {path} line {number} is not valid JSON") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise ConfigError(f"{key}: {path} line {number} has no string field {text_field!r} "
                                  f"(set data.text_field)")
            docs.append(record[text_field])
        return docs
    if path.suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (pyarrow.ArrowException, OSError) as error:
            raise ConfigError(f"{key}: {path} is not a readable parquet file ({str(error).splitlines()[0]})") from None
        if text_field not in table.column_names:
            raise ConfigError(f"{key}: {path} has no column {text_field!r} (columns: {table.column_names}; "
                              f"set data.text_field)")
        return [t for t in table.column(text_field).to_pylist() if isinstance(t, str)]
    return [path.read_text(encoding="utf-8", errors="replace")]


def load_documents(cfg: DataSection, files: list[str] | None = None, key: str = "data.files") -> list[str]:
    """The corpus as documents (or those of `files`), at most cfg.max_corpus_bytes of text, in a
    fixed order."""
    if files is not None:
        paths = _expand(files, key)
    else:
        paths = stdlib_files() if cfg.source == "stdlib" else _expand(cfg.files)
    docs, total = [], 0
    for path in paths:
        for doc in _documents_of(path, cfg.text_field, key):
            if total >= cfg.max_corpus_bytes:
                return docs
            doc = doc[: cfg.max_corpus_bytes - total]
            docs.append(doc)
            total += len(doc)
    if not docs:
        raise ConfigError(f"{'data' if files is None else key}: the corpus is empty")
    return docs


def corpus_key(cfg: DataSection, docs: list[str]) -> str:
    digest = hashlib.sha256()
    for doc in docs:
        digest.update(hashlib.sha256(doc.encode("utf-8", errors="replace")).digest())
    return digest.hexdigest()[:16]


# --------------------------------------------------------------------------------- tokenizer


@dataclass
class Tokenizer:
    """What the trainer needs of a tokenizer: encode many texts, the vocabulary size, EOS/PAD."""

    backend: object  # tokenizers.Tokenizer
    eos_id: int
    pad_id: int
    key: str  # identifies the vocabulary (for caches)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def save(self, path: Path) -> None:
        _atomic_write_bytes(path, self.backend.to_str().encode())


def _wrap(backend, key: str) -> Tokenizer:
    from hyperparallel.checkpoint.export import end_of_text_token  # (one list of them, export's)

    vocab = backend.get_vocab()
    eos = end_of_text_token(vocab)
    if eos is None:
        raise ConfigError(f"data.tokenizer: the tokenizer has no end-of-text token ({EOS!r} or '</s>')")
    return Tokenizer(backend, vocab[eos], vocab.get(PAD, vocab[eos]), key)


def train_builtin_tokenizer(docs: list[str], vocab_size: int) -> object:
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def load_tokenizer(cfg: DataSection, docs: list[str], corpus: str) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    if cfg.tokenizer == "builtin":
        key = f"bpe{cfg.vocab_size}-{corpus}"
        cached = cache_dir() / f"tokenizer-{key}.json"
        if cached.is_file():
            return _wrap(RustTokenizer.from_file(str(cached)), key)
        tokenizer = _wrap(train_builtin_tokenizer(docs, cfg.vocab_size), key)
        tokenizer.save(cached)
        return tokenizer
    return read_tokenizer_file(cfg)


def read_tokenizer_file(cfg: DataSection) -> Tokenizer:
    from tokenizers import Tokenizer as RustTokenizer

    path = Path(cfg.tokenizer).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"data.tokenizer: {file} does not exist (give a tokenizer.json or a directory holding one, "
                          f"or 'builtin')")
    payload = file.read_bytes()
    try:
        backend = RustTokenizer.from_str(payload.decode("utf-8"))
    except Exception as error:  # (the Rust library raises plain Exceptions; UnicodeDecodeError too)
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(f"data.tokenizer: {file} is not a tokenizers JSON file ({first})") from None
    return _wrap(backend, hashlib.sha256(payload).hexdigest()[:16])


# --------------------------------------------------------------------------------- sequences


def tokenize_corpus(docs: list[str], tokenizer: Tokenizer, corpus: str) -> list[np.ndarray]:
    """Token ids per document (EOS-terminated), cached on disk."""
    cached = cache_dir() / f"tokens-{corpus}-{tokenizer.key}.npz"
    if cached.is_file():
        with np.load(cached) as f:
            flat, ends = f["flat"], f["ends"]
        return np.split(flat, ends[:-1])
    ids = [np.asarray([*d, tokenizer.eos_id], dtype=np.int32) for d in tokenizer.encode_batch(docs)]
    import io

    buffer = io.BytesIO()
    np.savez(buffer, flat=np.concatenate(ids), ends=np.cumsum([len(i) for i in ids]))
    _atomic_write_bytes(cached, buffer.getvalue())
    return ids


def build_sequences(doc_ids: list[np.ndarray], seq_len: int, packing: bool, pad_id: int,
                    key: str = "data") -> torch.Tensor:
    """[N, seq_len] token ids. Packed: the documents end to end, cut into full rows (the tail
    is dropped). Unpacked: one document per row, cut to seq_len or padded with pad_id."""
    if packing:
        flat = np.concatenate(doc_ids)
        n = len(flat) // seq_len
        if n == 0:
            raise ConfigError(f"{key}: the corpus ({len(flat)} tokens) is shorter than one sequence "
                              f"(data.seq_len = {seq_len})")
        return torch.from_numpy(flat[: n * seq_len].astype(np.int64)).view(n, seq_len)
    rows = torch.full((len(doc_ids), seq_len), pad_id, dtype=torch.int64)
    for i, ids in enumerate(doc_ids):
        ids = ids[:seq_len]
        rows[i, : len(ids)] = torch.from_numpy(ids.astype(np.int64))
    return rows


class SequenceOrder:
    """The sequence at every global position: a fresh permutation per epoch, from (seed, epoch)."""

    def __init__(self, num_sequences: int, seed: int):
        self.n = num_sequences
        self.seed = seed
        self._epoch, self._perm = -1, None

    def index(self, position: int) -> int:
        epoch = position // self.n
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g)
        return int(self._perm[position % self.n])


@dataclass
class Batches:
    """Micro-batches of one rank: input ids and labels (padding masked out)."""

    sequences: torch.Tensor
    order: SequenceOrder
    global_batch: int
    micro_batch: int
    rank: int
    world_size: int
    pad_id: int
    packing: bool

    def micro_batches(self, step: int):
        """The micro-batches this rank trains on at optimizer step `step` (0-based)."""
        start = step * self.global_batch
        per_round = self.micro_batch * self.world_size
        for first in range(start, start + self.global_batch, per_round):
            lo = first + self.rank * self.micro_batch
            idx = [self.order.index(p) for p in range(lo, lo + self.micro_batch)]
            ids = self.sequences[idx]
            labels = ids.clone()
            if not self.packing:
                labels[ids == self.pad_id] = IGNORE
            yield ids, labels

    @property
    def sequences_per_epoch(self) -> int:
        return len(self.sequences)


class InOrder:
    """Positions in corpus order, wrapping around: the validation set, the same on any layout."""

    def __init__(self, num_sequences: int):
        self.n = num_sequences

    def index(self, position: int) -> int:
        return position % self.n


@dataclass
class Dataset:
    tokenizer: Tokenizer
    sequences: torch.Tensor
    corpus_key: str
    num_tokens: int
    validation: torch.Tensor | None = None  # [M, seq_len] held-out sequences


def _held_documents(count: int, fraction: float) -> int:
    held = max(1, round(count * fraction))
    if held >= count:
        raise ConfigError(f"data.validation: the corpus has {count} document(s), too few to hold out {fraction} of "
                          f"them; give validation files, more data, or null")
    return held


def _hold_out(ids: list[np.ndarray], cfg: DataSection) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(training, validation) token ids: the corpus's last cfg.validation of its tokens (packed:
    the document at the cut is split there) or of its documents (unpacked: rows are documents)."""
    fraction = cfg.validation
    if not cfg.packing:
        held = _held_documents(len(ids), fraction)
        return ids[:-held], ids[-held:]
    flat = np.concatenate(ids)
    cut = len(flat) - max(cfg.seq_len, round(len(flat) * fraction))
    if cut < cfg.seq_len:
        raise ConfigError(f"data.validation: the corpus ({len(flat)} tokens) is too short to hold out {fraction} of "
                          f"it and still train on one sequence of {cfg.seq_len}; give validation files, more data, "
                          f"or null")
    return [flat[:cut]], [flat[cut:]]


def prepare(cfg: DataSection) -> Dataset:
    docs = load_documents(cfg)
    extra_docs = load_documents(cfg, cfg.validation, "data.validation") if isinstance(cfg.validation, list) else None
    if isinstance(cfg.validation, float) and not cfg.packing:
        _held_documents(len(docs), cfg.validation)  # (its problem named before anything is written)
    key = corpus_key(cfg, docs)
    tokenizer = load_tokenizer(cfg, docs, key)  # (every input is read and checked before this first write)
    ids = tokenize_corpus(docs, tokenizer, key)
    validation = None
    if isinstance(cfg.validation, float):
        ids, held_out = _hold_out(ids, cfg)
        validation = build_sequences(held_out, cfg.seq_len, cfg.packing, tokenizer.pad_id)
    elif extra_docs is not None:
        held_out = tokenize_corpus(extra_docs, tokenizer, corpus_key(cfg, extra_docs))
        validation = build_sequences(held_out, cfg.seq_len, cfg.packing, tokenizer.pad_id, "data.validation")
    sequences = build_sequences(ids, cfg.seq_len, cfg.packing, tokenizer.pad_id)
    return Dataset(tokenizer, sequences, key, int(sum(len(i) for i in ids)), validation)
