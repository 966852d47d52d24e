"""Training data: a corpus tokenized once into token shards on disk, every rank reading only its
rows of them, memory-mapped, in an order that is a pure function of the step.

- `sources`: text, jsonl / json, parquet, arrow files and Hugging Face `datasets` directories,
  read a bounded piece at a time; the default corpus is this Python's own standard library.
- `tokenizer`: the builtin byte-level BPE (trained here on the corpus, cached), a tokenizer.json,
  or a Hugging Face tokenizer or model directory, with its chat template.
- `formats`: text, chat and prompt/completion records as token ids and the tokens the loss counts.
- `shards`: the streaming pass that tokenizes a corpus (worker processes) into shards.
- `rows`, `batches`: a rank's rows (packed, with document masks) and micro-batches.
- `dataset`: all of it for a run (`prepare`; `open_prepared` on the ranks that wait).

The package imports none of its modules until a name is used (`lazy_exports`): `shards` and
what it imports need no torch (a spawned tokenizing worker imports only them).
"""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "batches": ("Batches", "InOrder", "MicroBatch", "SequenceOrder"),
    "dataset": ("Dataset", "cache_root", "describe", "input_problems", "open_prepared", "prepare"),
    "rows": ("IGNORE", "DocumentRows", "PackedRows", "TensorRows", "TokenStore"),
    "tokenizer": ("EOS", "PAD", "TOKENIZER_FILE", "Tokenizer", "load_tokenizer", "tokenizer_source",
                  "tokenizer_vocab_size"),
})
