"""What a W&B run wrote, read back from W&B's own files (tests/train/test_wandb.py).

wandb 0.31 ships no reader of its run files, so this is one: RUN_DIR/wandb/offline-run-*/run-ID.wandb
is W&B's transaction log, a 7-byte header (b":W&B", magic 0xBEE1, version 0) then 32 KiB blocks of
records, each <crc32, length, type> (1 whole, 2 first part, 3 middle, 4 last) and its bytes; the
records are W&B's own protobuf (wandb.proto.wandb_internal_pb2.Record). Each check is strict:
a file W&B changed the layout of fails here rather than read as empty.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK, HEADER = 32768, 7


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert struct.unpack("<4sHB", data[:HEADER]) == (b":W&B", 0xBEE1, 0), path
    pos, parts = HEADER, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if left < HEADER or (length, kind) == (0, 0):  # a block's padding
            pos += left
            continue
        body = data[pos + HEADER:pos + HEADER + length]
        assert len(body) == length and zlib.crc32(body, zlib.crc32(bytes([kind]))) == crc, (path, pos)
        pos += HEADER + length
        parts.append(body)
        if kind in (2, 3):  # more of this record follows
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(b"".join(parts))
        parts = []
        yield record


def _mapping(items) -> dict:
    out = {}
    for item in items:
        keys = list(item.nested_key) or [item.key]
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = json.loads(item.value_json)
    return out


def read_run(directory: Path) -> dict:
    """One offline run directory: its id, name, project, tags, whether it resumed, the config
    (without W&B's own `_wandb`) and the history rows (each with W&B's `_step`)."""
    (path,) = directory.glob("run-*.wandb")
    run = {"config": {}, "history": []}
    for record in records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            r = record.run
            run.update(id=r.run_id, name=r.display_name, project=r.project, tags=list(r.tags), resumed=r.resume)
            run["config"].update(_mapping(r.config.update))
        elif kind == "config":
            run["config"].update(_mapping(record.config.update))
        elif kind == "history":
            run["history"].append(_mapping(record.history.item))
    run["config"].pop("_wandb", None)
    return run


def offline_runs(run_dir: Path) -> list[dict]:
    """Every offline run W&B wrote under a run directory, in the order they started."""
    return [read_run(d) for d in sorted((run_dir / "wandb").glob("offline-run-*"))]
