"""Read a Hugging Face safetensors directory slice by slice: each rank reads only its part.

A directory written by transformers' `save_pretrained` (one `model.safetensors`, or shards and
`model.safetensors.index.json`) holds the tensors in the checkpoint's original format, which
transformers 5 converts on load: Qwen3-MoE and DeepSeek-V3 keep one matrix per expert
(`mlp.experts.E.gate_proj.weight`, ...) that the model stacks as `mlp.experts.gate_up_proj`
[E, 2I, H] (the experts stacked on dim 0, gate then up along dim 1) and `mlp.experts.down_proj`
[E, H, I]; DeepSeek-V4 also renames most keys (`head.weight` is `lm_head.weight`,
`.ffn.experts.E.w1.weight` the gate, ...). transformers' own mapping is the one source of truth
for those names (`get_model_conversion_mapping`, `rename_source_key`, as `from_pretrained` uses
them); its operations are read as placements instead of being run on whole tensors:

- a rename: the file's tensor is the model's, whole;
- `MergeModulelist(dim=0)`: the number matched by `*` in the source pattern is the tensor's index
  along the model tensor's dim 0 (the file's tensor lacks that dim);
- `Concatenate(dim=1)`: the j-th source pattern is the j-th block along dim 1, in order.

Anything else (a split, a transpose, a permutation) is refused with the family and the operation.
So `plan_hf_read` maps every file tensor to its block of a model tensor from the headers alone and
checks, before anything is allocated, that the files cover every tensor of the model exactly once
with the model's shapes; `HFReadPlan.read` then fills any block of any tensor (an FSDP rank's rows,
an expert-parallel rank's experts, a TP rank's columns) reading from disk only the slices that
overlap it, in a thread per file.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor, nn

from hyperparallel.checkpoint.sharded import Chunk
from hyperparallel.errors import CheckpointError, ShapeError

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own bound on a header


@dataclass(frozen=True, slots=True)
class FileTensor:
    """One tensor of the files and the block of its model tensor it holds."""

    file: str  # its file's name in the directory
    key: str  # its name in that file
    shape: tuple[int, ...]
    expert: int | None  # its index along the model tensor's dim 0 (MergeModulelist), which it lacks
    column: int  # its first index along the model tensor's dim 1 (Concatenate(dim=1)); 0 otherwise

    def box(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Its offsets and sizes in the model tensor's dims."""
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        if self.expert is not None:
            offsets, sizes = [self.expert, *offsets], [1, *sizes]
        if self.column:
            offsets[1] = self.column
        return tuple(offsets), tuple(sizes)


@dataclass(frozen=True)
class HFReadPlan:
    """Where each tensor of a model is in a safetensors directory (`plan_hf_read`); `read` fills
    blocks of them."""

    directory: Path
    shapes: Mapping[str, tuple[int, ...]]  # every state-dict key of the model: its whole shape
    sources: Mapping[str, tuple[FileTensor, ...]]  # every key: the file tensors that make it up
    ties: Mapping[str, str]  # a key with no file tensors of its own -> the key it is tied to

    def read(self, targets: Mapping[str, tuple[Tensor, Chunk | None]], *, threads: int = 4) -> None:
        """Fill each destination in place with its block of the model tensor: `targets` maps a
        state-dict key to (destination, chunk), the chunk's block [offsets, offsets + sizes) of the
        global tensor, or None for all of it. Only the file slices that overlap a block are read,
        converted to the destination's dtype on the fly; files are read in parallel, each opened
        once."""
        per_file: dict[str, list[tuple[str, tuple[slice, ...] | None, Tensor]]] = {}
        for key, (destination, chunk) in targets.items():
            for file, name, where, view in self._requests(key, destination, chunk):
                per_file.setdefault(file, []).append((name, where, view))
        if not per_file:
            return
        with ThreadPoolExecutor(max_workers=max(1, min(threads, len(per_file)))) as pool:
            for done in [pool.submit(self._read_file, file, requests) for file, requests in per_file.items()]:
                done.result()

    def _requests(self, key: str, destination: Tensor, chunk: Chunk | None):
        """(file, name, the file tensor's slices or None for all of it, destination view) of
        every file tensor that overlaps the block of `key` that `destination` holds."""
        sources = self.sources.get(key)
        if sources is None:
            raise CheckpointError(f"checkpoint {self.directory}: {key} is not a tensor of the model this read was "
                                  f"planned for")
        shape = self.shapes[key]
        if not shape and chunk is not None and tuple(chunk.global_shape) == (1,):  # chunk_of's 0-d tensor: one row
            if chunk.empty:
                return
            chunk, destination = None, destination.reshape(())
        if chunk is None:
            first, sizes = (0,) * len(shape), shape
        else:
            if tuple(chunk.global_shape) != shape:
                raise ShapeError(f"{key}: the chunk is of a {tuple(chunk.global_shape)} tensor but the model's is "
                                 f"{shape}")
            first, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if tuple(destination.shape) != tuple(sizes):
            raise ShapeError(f"{key}: the destination is {tuple(destination.shape)} but its block is {tuple(sizes)}")
        for source in sources:
            offsets, lengths = source.box()
            low = [max(o, f) for o, f in zip(offsets, first, strict=True)]
            high = [min(o + n, f + s) for o, n, f, s in zip(offsets, lengths, first, sizes, strict=True)]
            if any(h <= lo for lo, h in zip(low, high, strict=True)):
                continue
            whole = all(lo == o and h == o + n for lo, h, o, n in zip(low, high, offsets, lengths, strict=True))
            view_index: list = [slice(lo - f, h - f) for lo, h, f in zip(low, high, first, strict=True)]
            file_slices = [slice(lo - o, h - o) for lo, h, o in zip(low, high, offsets, strict=True)]
            if source.expert is not None:  # the file tensor lacks the experts' dim
                view_index[0], file_slices = low[0] - first[0], file_slices[1:]
            view = destination[tuple(view_index)] if view_index else destination
            yield source.file, source.key, None if whole else tuple(file_slices), view

    def _read_file(self, file: str, requests: list[tuple[str, tuple[slice, ...] | None, Tensor]]) -> None:
        """Read `requests` from one file with positioned reads ([Note: no mmap])."""
        path = self.directory / file
        name = None
        try:
            entries = _entries(path)
            fd = os.open(path, os.O_RDONLY)
            try:
                for name, where, view in requests:
                    dtype, start, shape = entries[name]
                    if not isinstance(dtype, torch.dtype):
                        raise ValueError(f"its dtype {dtype} is not one this reader knows")
                    _read_block(fd, dtype, start, shape, where, view)
            finally:
                os.close(fd)
        except (OSError, ValueError, KeyError) as error:  # (a device's out-of-memory is not the file's fault)
            first = str(error).splitlines()[0] if str(error) else type(error).__name__
            what = f"{name} from {file}" if name is not None else file
            raise CheckpointError(f"checkpoint {self.directory}: cannot read {what}: {first}") from None


# [Note: no mmap] safetensors' own reader maps the file: every page a rank touches then counts in
# its resident memory until the file is closed (measured: one process reading a whole model rose
# by twice its bytes, the pages and the copies). Positioned reads (os.preadv) put the bytes
# straight into the destination when the block is whole rows of a tensor of the same dtype (an
# FSDP or expert-parallel rank's rows: contiguous in the file), and otherwise into a buffer of
# those rows only (a TP rank's columns, a dtype conversion), so a rank holds its blocks plus at
# most one read's rows.
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_MAX_READ = 1 << 30  # bytes per preadv call (Linux returns at most ~2 GiB per call)


def _entries(path: Path) -> dict[str, tuple[torch.dtype, int, tuple[int, ...]]]:
    """{name: (dtype, its first byte in the file, shape)} from a safetensors header."""
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(length))
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        out[name] = (_DTYPES.get(entry["dtype"], entry["dtype"]), 8 + length + entry["data_offsets"][0],
                     tuple(entry["shape"]))  # (an unknown dtype is refused when that tensor is read)
    return out


def _read_into(fd: int, buffer: Tensor, offset: int) -> None:
    view = memoryview(buffer.view(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done: done + _MAX_READ]], offset + done)
        if got <= 0:
            raise OSError(f"the file ends {offset + done} bytes in, inside a tensor")
        done += got


def _read_block(fd: int, dtype: torch.dtype, start: int, shape: tuple[int, ...], where: tuple[slice, ...] | None,
                view: Tensor) -> None:
    """view <- tensor[where] (all of it for None), the tensor at `start` of `fd`, row-major."""
    rows = shape[0] if shape else 1
    first, last = (0, rows) if where is None or not shape else (where[0].start, where[0].stop)
    row_bytes = (torch.Size(shape[1:]).numel() if shape else 1) * dtype.itemsize
    rest = tuple(slice(0, n) for n in shape[1:]) if where is None else where[1:]
    whole_rows = all(s.start == 0 and s.stop == n for s, n in zip(rest, shape[1:], strict=True))
    if whole_rows and view.dtype == dtype and view.is_contiguous() and view.device.type == "cpu":
        _read_into(fd, view, start + first * row_bytes)  # straight into the destination
        return
    # (a GPU destination: read into host memory, then one copy to the device)
    buffer = torch.empty((last - first, *shape[1:]) if shape else (), dtype=dtype)
    _read_into(fd, buffer, start + first * row_bytes)
    view.copy_(buffer[(slice(None), *rest)] if shape else buffer)


def read_headers(directory: str | os.PathLike) -> dict[str, dict[str, tuple[int, ...]]]:
    """{file: {tensor name: shape}} of a Hugging Face directory's safetensors files, from their
    headers only (the files the index names, or `model.safetensors`)."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
            raise CheckpointError(f"checkpoint {directory}: {INDEX_FILE} is not a safetensors index ({error})") \
                from None
    elif (directory / SAFETENSORS_FILE).is_file():
        weight_map, files = None, [SAFETENSORS_FILE]
    else:
        raise CheckpointError(f"checkpoint {directory} has neither {SAFETENSORS_FILE} nor {INDEX_FILE}: not a Hugging "
                              f"Face safetensors directory")
    headers = {file: _header(directory, file) for file in files}
    if weight_map is not None:
        problems = [f"checkpoint {directory}: {INDEX_FILE} puts {name} in {file}, which has no such tensor"
                    for name, file in weight_map.items() if name not in headers[file]]
        if problems:
            raise CheckpointError("\n".join(problems))
    return headers


def _header(directory: Path, file: str) -> dict[str, tuple[int, ...]]:
    path = directory / file
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= min(_MAX_HEADER_BYTES, os.fstat(f.fileno()).st_size - 8):
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(f.read(length))
        return {name: tuple(entry["shape"]) for name, entry in header.items() if name != "__metadata__"}
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {directory}: {file} is missing") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise CheckpointError(f"checkpoint {directory}: {file} is not a safetensors file ({error})") from None


class _Found(NamedTuple):
    """A file tensor, named in the model's terms (`_KeyMapper.model_key`)."""

    name: str
    file: str
    shape: tuple[int, ...]
    expert: int | None  # its index along the model tensor's dim 0 (MergeModulelist)
    part: int | None  # its block along dim 1 (Concatenate(dim=1))
    patterns: tuple[str, ...] | None  # the source patterns of the converter that matched it


@dataclass(frozen=True)
class _Layout:
    """How the tensors a converter's source pattern matches sit in its model tensor."""

    stacked: re.Pattern | None  # (MergeModulelist) finds the expert's number in the renamed key
    part: int | None  # (Concatenate(dim=1)) which block along dim 1


class _KeyMapper:
    """transformers' renaming of a file's key to the model's, as `from_pretrained` does it, with
    the block of the model tensor the file's tensor holds."""

    def __init__(self, model: nn.Module, directory: Path, state: Mapping[str, Tensor]):
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming

        transforms = get_model_conversion_mapping(model)
        self.renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self.converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self.converter_of = {pattern: c for c in self.converters for pattern in c.source_patterns}
        self.layouts: dict[str, _Layout] = {}
        self.model, self.directory, self.state = model, directory, state
        self.prefix = getattr(model, "base_model_prefix", None) or None

    def model_key(self, key: str) -> tuple[str, int | None, int | None, tuple[str, ...] | None]:
        """(the model's key, the expert's index along dim 0 or None, the block along dim 1 or None,
        the source patterns of the converter that matched or None)."""
        from transformers.core_model_loading import rename_source_key

        renamed, pattern = rename_source_key(key, self.renamings, self.converters, self.prefix, self.state)
        if renamed not in self.state and key in self.state:  # (as from_pretrained: the key was the model's already)
            renamed, pattern = rename_source_key(key, [], [], self.prefix, self.state)
        if pattern is None:
            return renamed, None, None, None
        layout = self._layout(pattern)
        expert = None
        if layout.stacked is not None:
            inner = rename_source_key(key, self.renamings, [])[0]  # what the converter matched
            found = layout.stacked.search(inner)
            if found is None:
                raise CheckpointError(f"checkpoint {self.directory}: cannot tell which expert {key} is (pattern "
                                      f"{pattern!r})")
            expert = int(found["expert"])
        return renamed, expert, layout.part, tuple(self.converter_of[pattern].source_patterns)

    def _layout(self, pattern: str) -> _Layout:
        layout = self.layouts.get(pattern)
        if layout is None:
            layout = self.layouts[pattern] = self._interpret(self.converter_of[pattern], pattern)
        return layout

    def _interpret(self, converter, pattern: str) -> _Layout:
        from transformers.core_model_loading import Concatenate, MergeModulelist

        operations = list(converter.operations)
        stacked = bool(operations) and isinstance(operations[0], MergeModulelist) and operations[0].dim == 0
        rest = operations[1:] if stacked else operations
        concatenated = len(rest) == 1 and isinstance(rest[0], Concatenate) and rest[0].dim == 1
        sources, targets = converter.source_patterns, converter.target_patterns
        if not (stacked or concatenated) or len(rest) > int(concatenated) or len(targets) != 1 \
                or (not concatenated and len(sources) != 1) or (stacked and not all("*." in p for p in sources)):
            config = getattr(self.model, "config", None)
            raise CheckpointError(
                f"checkpoint {self.directory}: sharded loading does not support model type "
                f"{getattr(config, 'model_type', None)!r} ({type(self.model).__name__})'s conversion of {sources} to "
                f"{targets} by {operations}: it reads renames, MergeModulelist(dim=0) and Concatenate(dim=1)")
        return _Layout(
            stacked=re.compile(pattern.replace("*.", r"(?P<expert>\d+)\.", 1)) if stacked else None,
            part=converter.source_patterns.index(pattern) if concatenated else None,
        )


def _shown(pattern: str, expert: int | None = None) -> str:
    """A source pattern (with the expert's number), as a name to print."""
    if expert is not None:
        pattern = pattern.replace("*", str(expert), 1)
    return pattern.replace("\\", "").lstrip("^.")


def plan_hf_read(directory: str | os.PathLike, model: nn.Module) -> HFReadPlan:
    """Where every tensor of `model` (its whole, global shapes: typically on the meta device) is in
    the Hugging Face safetensors directory, from the files' headers alone.

    Refused with one CheckpointError listing every problem (a line each) unless the files cover
    every persistent state-dict entry exactly once with the model's shape (a tied alias counts as
    covered by the tensor it is tied to) and every file tensor is one of the model's (or one the
    model's class ignores on load, as DeepSeek-V3's multi-token-prediction layer)."""
    directory = Path(directory)
    headers = read_headers(directory)
    state = model.state_dict(keep_vars=True)
    shapes = {key: tuple(value.shape) for key, value in state.items()}
    mapper = _KeyMapper(model, directory, state)
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    from transformers.core_model_loading import dot_natural_key

    problems: list[str] = []
    found: dict[str, list[_Found]] = {}
    seen: dict[str, str] = {}
    names = sorted(((name, file, shape) for file, tensors in headers.items() for name, shape in tensors.items()),
                   key=lambda entry: dot_natural_key(entry[0]))  # the order from_pretrained renames them in
    for name, file, shape in names:
        if name in seen:
            problems.append(f"checkpoint {directory}: {name} is in both {seen[name]} and {file}")
            continue
        seen[name] = file
        key, expert, part, patterns = mapper.model_key(name)
        if key in state:
            found.setdefault(key, []).append(_Found(name, file, shape, expert, part, patterns))
        elif not any(p.search(key) for p in ignored):
            loaded_as = f" (it would load as {key})" if key != name else ""
            problems.append(f"checkpoint {directory}: {name} in {file} is no tensor of the model{loaded_as}")

    sources: dict[str, tuple[FileTensor, ...]] = {}
    for key, entries in found.items():
        placed = _place(directory, key, shapes[key], entries, problems)
        if placed is not None:
            sources[key] = placed

    ties: dict[str, str] = {}
    aliases: dict[int, list[str]] = {}
    for key, value in state.items():
        aliases.setdefault(id(value), []).append(key)
    for group in aliases.values():
        present = [key for key in group if key in found]
        for key in group:
            if key not in found and present:
                ties[key] = present[0]
                if present[0] in sources:
                    sources[key] = sources[present[0]]
    problems += [f"checkpoint {directory}: {key} is missing from the files" for key in state
                 if key not in found and key not in ties]
    if problems:
        raise CheckpointError("\n".join(problems))
    return HFReadPlan(directory, shapes, sources, ties)


def _place(directory: Path, key: str, shape: tuple[int, ...], entries: list[_Found],
           problems: list[str]) -> tuple[FileTensor, ...] | None:
    """The file tensors of one model tensor with their blocks, or None after adding to
    `problems` what keeps them from making it up exactly once with the model's shape."""
    first = entries[0]
    if len({entry.patterns for entry in entries}) > 1:
        other = next(entry for entry in entries if entry.patterns != first.patterns)
        problems.append(f"checkpoint {directory}: {key} is given twice: by {first.name} and {other.name}")
        return None
    if first.patterns is None:  # renamed: one tensor, the whole of it
        if len(entries) > 1:
            problems.append(f"checkpoint {directory}: {key} is given twice: by {first.name} and {entries[1].name}")
        elif first.shape != shape:
            problems.append(f"checkpoint {directory}: {key} is {shape} in the model but {first.shape} in the files")
        else:
            return (FileTensor(first.file, first.name, first.shape, None, 0),)
        return None

    stacked, concatenated = first.expert is not None, first.part is not None
    parts = len(first.patterns) if concatenated else 1
    count = 1 + max(entry.expert for entry in entries) if stacked else 1
    by_block: dict[tuple[int, int], _Found] = {}
    before = len(problems)
    for entry in entries:
        block = (entry.part or 0, entry.expert or 0)
        if block in by_block:
            problems.append(f"checkpoint {directory}: {key} is given twice: by {by_block[block].name} and {entry.name}")
        by_block[block] = entry
    part_shapes = []
    for j, pattern in enumerate(first.patterns[:parts]):
        blocks = [by_block.get((j, e)) for e in range(count)]
        present = [entry for entry in blocks if entry is not None]
        if not present:
            problems.append(f"checkpoint {directory}: {key} lacks every tensor of {_shown(pattern)} in the files")
            continue
        problems += [f"checkpoint {directory}: {key} lacks {_shown(pattern, e)} (expert {e}) in the files"
                     for e, entry in enumerate(blocks) if entry is None]
        problems += [f"checkpoint {directory}: {key} cannot be assembled: {entry.name} is {entry.shape} in the files "
                     f"but {present[0].name} is {present[0].shape}" for entry in present if entry.shape != present[0].shape]
        part_shapes.append(present[0].shape)
    if len(problems) > before:
        return None
    along = 0 if stacked else 1  # the model tensor's dim 1, in the file tensors' dims
    rest = {s[:along] + s[along + 1:] for s in part_shapes}
    if parts > 1 and (len(rest) > 1 or any(len(s) <= along for s in part_shapes)):
        problems.append(f"checkpoint {directory}: {key} cannot be assembled: its blocks along dim 1 are "
                        f"{', '.join(map(str, part_shapes))} in the files")
        return None
    assembled = list(part_shapes[0])
    if concatenated:
        assembled[along] = sum(s[along] for s in part_shapes)
    assembled = tuple([count] + assembled if stacked else assembled)
    if assembled != shape:
        problems.append(f"checkpoint {directory}: {key} is {shape} in the model but {assembled} in the files")
        return None
    columns = [sum(s[along] for s in part_shapes[:j]) for j in range(parts)]
    placed = [FileTensor(e.file, e.name, e.shape, e.expert, columns[e.part or 0]) for e in entries]
    return tuple(sorted(placed, key=lambda t: (t.expert or 0, t.column)))
