"""Where a corpus's records come from, read a bounded piece at a time.

A source is a file of one of these kinds, by its name:
- text (any other suffix: .txt, .md, .py, ...): the file is one document, `{text_field: ...}`,
  read whole (a corpus of large files belongs in jsonl, parquet or arrow);
- .jsonl / .json: one JSON record per line (a .json holding one array is read whole);
- .parquet: a batch of rows at a time, only the columns the format reads;
- .arrow: Arrow IPC (the stream format `datasets.save_to_disk` writes, or the file format),
  record batch by record batch, only the columns the format reads.
A directory in data.files is a Hugging Face `datasets` directory: one `save_to_disk` wrote
(state.json names its arrow files; a DatasetDict's dataset_dict.json names its splits, of which
`data.split` is read), or a dataset repository's files (every .jsonl, .json, .parquet and .arrow
under it, in name order). Nothing here imports `datasets`: pyarrow reads what it wrote.

A corpus is identified by its files' paths, sizes and modification times (`files_key`): a warm
cache is found without reading the corpus.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hyperparallel.errors import ConfigError

RECORD_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow")
_BATCH_ROWS = 1024  # rows of a parquet or arrow file decoded at once


@dataclass(frozen=True)
class Source:
    path: Path
    kind: str  # text | jsonl | json | parquet | arrow


def _kind(path: Path) -> str:
    return {".jsonl": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}.get(path.suffix, "text")


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    # tests hold deliberately odd encodings and generated data, and installed packages are not
    # the standard library; the library itself is plain code (about 13 MB)
    skipped = ("test", "site-packages", "dist-packages")
    return sorted(p for p in root.rglob("*.py") if not any(s in p.relative_to(root).parts[0] for s in skipped))


def _json_file(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"data.files: {path} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"data.files: {path} is not a JSON object")
    return value


def _dataset_directory(directory: Path, split: str, key: str) -> tuple[list[Path], list[str]]:
    """The files of a `datasets` directory (see the module's docstring), or why not."""
    splits = directory / "dataset_dict.json"
    if splits.is_file():
        names = _json_file(splits).get("splits", [])
        if split not in names:
            return [], [f"{key}: {directory} is a DatasetDict with splits {names}, not {split!r} (set data.split)"]
        directory = directory / split
    state = directory / "state.json"
    if state.is_file():
        files = [directory / f["filename"] for f in _json_file(state).get("_data_files", [])]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            return [], [f"{key}: {directory}'s state.json names files that are missing: {', '.join(missing)}"]
        return files, []
    files = sorted(p for p in directory.rglob("*") if p.suffix in RECORD_SUFFIXES and p.is_file()
                   and not any(part.startswith(".") for part in p.relative_to(directory).parts))
    if not files:
        return [], [f"{key}: {directory} holds no .jsonl, .json, .parquet or .arrow file (nor a save_to_disk dataset)"]
    return files, []


def matches(pattern: str) -> list[str]:
    """The paths a data pattern names: ~ expanded, globs (** recursive), sorted."""
    return sorted(glob.glob(os.path.expanduser(pattern), recursive=True))


def find(patterns: list[str], key: str, split: str = "train") -> tuple[list[Source], list[str]]:
    """The sources `patterns` name (globs allowed) and every problem a look finds (missing,
    unreadable, an empty dataset directory), all at once; nothing is read in full."""
    sources: list[Source] = []
    problems = []
    for pattern in patterns:
        paths = matches(pattern)
        if not paths:
            problems.append(f"{key}: {pattern!r} matches no file")
        for match in map(Path, paths):
            if match.is_dir():
                try:
                    files, found = _dataset_directory(match, split, key)
                except ConfigError as error:
                    files, found = [], [str(error)]
                problems += found
                sources += [Source(f, _kind(f)) for f in files]
            elif not match.is_file():
                problems.append(f"{key}: {match} is not a file")
            elif not os.access(match, os.R_OK):
                problems.append(f"{key}: {match} is not readable")
            else:
                sources.append(Source(match, _kind(match)))
    return sources, problems


def corpus_sources(files: list[str] | None, source: str, key: str, split: str) -> list[Source]:
    """The sources of a corpus (data.files, or this Python's standard library), or a ConfigError."""
    if source == "stdlib" and files is None:
        return [Source(p, "text") for p in stdlib_files()]
    found, problems = find(files or [], key, split)
    if problems:
        raise ConfigError("\n".join(problems))
    return found


def files_key(sources: list[Source]) -> str:
    """What identifies a corpus without reading it: each file's path, size and modification time."""
    digest = hashlib.sha256()
    for s in sources:
        stat = s.path.stat()
        digest.update(f"{s.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


# ------------------------------------------------------------------------------------ records


def fields_of(fmt: str, text_field: str) -> list[str]:
    """The fields a format reads: the only columns decoded from a parquet or arrow file."""
    return {"text": [text_field], "chat": ["messages", "tools"]}.get(fmt, ["prompt", "completion", "tools"])


def records(source: Source, text_field: str, key: str, fields: list[str] | None = None) -> Iterator[tuple[str, dict]]:
    """(where, record) for each record of a source, a bounded piece of the file at a time;
    `where` names it for messages ("data.files: FILE line 7", "data.files: FILE row 12").
    `fields`: of a table's columns, those read (the ones it has; None: all)."""
    path = source.path
    if source.kind == "text":
        yield f"{key}: {path}", {text_field: path.read_text(encoding="utf-8", errors="replace")}
    elif source.kind in ("jsonl", "json"):
        yield from _json_records(path, key)
    elif source.kind == "parquet":
        yield from _parquet_records(path, key, fields)
    else:
        yield from _arrow_records(path, key, fields)


def _columns(names: list[str], fields: list[str] | None) -> list[str] | None:
    return None if fields is None else [n for n in names if n in fields]


def _json_records(path: Path, key: str) -> Iterator[tuple[str, dict]]:
    with open(path, encoding="utf-8-sig", errors="replace") as f:  # (-sig: a byte-order mark is no JSON)
        first = f.read(1)
        while first.isspace():
            first = f.read(1)
        f.seek(0)
        if path.suffix == ".json" and first == "[":  # one JSON array: read whole (jsonl streams)
            try:
                array = json.load(f)
            except json.JSONDecodeError as error:
                raise ConfigError(f"{key}: {path} is not valid JSON ({error})") from None
            for number, record in enumerate(array):
                yield _checked(record, f"{key}: {path} item {number}")
            return
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise ConfigError(f"{key}: {path} line {number} is not valid JSON") from None
            yield _checked(record, f"{key}: {path} line {number}")


def _checked(record, where: str) -> tuple[str, dict]:
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not a JSON object")
    return where, record


def _parquet_records(path: Path, key: str, fields: list[str] | None) -> Iterator[tuple[str, dict]]:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pyarrow.ArrowException, OSError) as error:
        raise ConfigError(f"{key}: {path} is not a readable parquet file ({str(error).splitlines()[0]})") from None
    row = 0
    for batch in table.iter_batches(batch_size=_BATCH_ROWS, columns=_columns(table.schema_arrow.names, fields)):
        for record in batch.to_pylist():
            yield f"{key}: {path} row {row}", record
            row += 1


def _arrow_records(path: Path, key: str, fields: list[str] | None) -> Iterator[tuple[str, dict]]:
    import pyarrow
    import pyarrow.ipc as ipc

    try:
        # (memory-mapped: a batch's columns are read as its rows are decoded)
        source = pyarrow.memory_map(str(path))
        try:
            reader = ipc.open_stream(source)
            batches = iter(reader)
        except pyarrow.ArrowInvalid:
            reader = ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except (pyarrow.ArrowException, OSError) as error:
        raise ConfigError(f"{key}: {path} is not a readable Arrow file ({str(error).splitlines()[0]})") from None
    columns = _columns(reader.schema.names, fields)
    row = 0
    for batch in batches:
        if columns is not None:
            batch = batch.select(columns)
        for start in range(0, batch.num_rows, _BATCH_ROWS):
            for record in batch.slice(start, _BATCH_ROWS).to_pylist():
                yield f"{key}: {path} row {row}", record
                row += 1
