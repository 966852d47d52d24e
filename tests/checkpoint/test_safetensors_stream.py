"""`SafetensorsWriter`: a file laid out from names, dtypes and shapes, its tensors written one at a
time in any order, reads back with safetensors as `save_file`'s would."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hyperparallel.checkpoint.safetensors_stream import SafetensorsWriter, TensorSpec, file_bytes
from hyperparallel.errors import CheckpointError


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "odd.bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),  # 30 bytes: the next would be misaligned
        "ids": torch.arange(7),
        "scalar": torch.tensor(2.5),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "weight": torch.randn(4, 6, 2, generator=g),
        "half": torch.randn(9, generator=g).half(),
    }


def specs_of(named: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, t.dtype, tuple(t.shape)) for name, t in named.items()]


def test_a_file_written_in_any_order_reads_back_as_save_files_would(tmp_path):
    named = tensors()
    path = tmp_path / "streamed.safetensors"
    with SafetensorsWriter(path, specs_of(named), {"format": "pt"}) as writer:
        for name in ["weight", "scalar", "odd.bf16", "empty", "ids", "half", "mask"]:
            writer.write(name, named[name])
    save_file(named, tmp_path / "whole.safetensors", metadata={"format": "pt"})

    got, want = load_file(path), load_file(tmp_path / "whole.safetensors")
    assert got.keys() == want.keys() == named.keys()
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert torch.equal(f.get_slice("weight")[1:3, 2:4], named["weight"][1:3, 2:4])
    assert path.stat().st_size == file_bytes(specs_of(named), {"format": "pt"})
    with open(path, "rb") as f:  # the data starts aligned: a padded header
        assert (8 + int.from_bytes(f.read(8), "little")) % 8 == 0


def test_a_tensor_not_as_its_header_says_or_never_written_is_refused_and_the_file_removed(tmp_path):
    named = tensors()
    path = tmp_path / "bad.safetensors"
    writer = SafetensorsWriter(path, specs_of(named))
    with pytest.raises(CheckpointError, match=r"weight is torch.float32 \(4, 6\), but its header says"):
        writer.write("weight", named["weight"][:, :, 0])
    with pytest.raises(CheckpointError, match="nothing is not in this file"):
        writer.write("nothing", named["weight"])
    writer.write("ids", named["ids"])
    with pytest.raises(CheckpointError, match="ids is written already"):
        writer.write("ids", named["ids"])
    with pytest.raises(CheckpointError, match="6 tensors were never written"):
        writer.close()
    assert not path.exists()

    with pytest.raises(OSError, match="disk full"), SafetensorsWriter(path, specs_of(named)):
        raise OSError("disk full")
    assert not path.exists()
