"""A checkpoint is never half-written, never taken for another model's, and never runs code when read."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from hyperparallel import checkpoint
from hyperparallel.errors import CheckpointError


def model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))


def trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    m = model(seed)
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(5, 6)).sum().backward()
    opt.step()
    opt.zero_grad()
    return m, opt


def test_save_then_load_restores_model_optimizer_and_extra(tmp_path):
    m, opt = trained()
    checkpoint.save(tmp_path / "step_1", m, opt, extra={"step": 1, "note": "x"})
    other, other_opt = trained(seed=1)
    manifest = checkpoint.load(tmp_path / "step_1", other, other_opt)
    assert manifest["extra"] == {"step": 1, "note": "x"}
    for a, b in zip(m.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)
        for k in opt.state[a]:
            assert torch.equal(opt.state[a][k], other_opt.state[b][k])
    assert other_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    assert isinstance(other_opt.param_groups[0]["betas"], tuple)


KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch
    from torch.distributed.checkpoint import FileSystemWriter
    sys.path.insert(0, {root!r})
    from tests.dist.test_checkpoint_safety import trained
    from hyperparallel import checkpoint

    m, opt = trained()
    checkpoint.save({path!r} + "/step_1", m, opt, extra={{"step": 1}})
    m, opt = trained(seed=7)
    write = FileSystemWriter.write_data

    def write_half_then_die(self, plan, planner):
        future = write(self, plan, planner)
        future.wait()
        for name in os.listdir(self.path):  # a data file cut short, as a crash mid-write leaves it
            if name.endswith(".distcp"):
                full = os.path.join(self.path, name)
                os.truncate(full, os.path.getsize(full) // 2)
        os.kill(os.getpid(), signal.SIGKILL)

    FileSystemWriter.write_data = write_half_then_die
    checkpoint.save({path!r} + "/step_2", m, opt, extra={{"step": 2}})
""")


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_loadable(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = KILLED_SAVE.format(root=root, path=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert (tmp_path / "step_2.tmp").is_dir() and not (tmp_path / "step_2").exists()
    assert checkpoint.complete_checkpoints(tmp_path) == [tmp_path / "step_1"]
    m, opt = trained(seed=3)
    assert checkpoint.load(tmp_path / "step_1", m, opt)["extra"] == {"step": 1}
    want, _ = trained()
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), want.parameters(), strict=True))
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / "step_2.tmp", m, opt)
    # the next save of that step clears what the killed one left and completes
    checkpoint.save(tmp_path / "step_2", m, opt, extra={"step": 2})
    assert checkpoint.complete_checkpoints(tmp_path) == [tmp_path / "step_1", tmp_path / "step_2"]
    assert not (tmp_path / "step_2.tmp").exists()


def test_a_checkpoint_of_another_model_names_the_key_and_both_shapes(tmp_path):
    m, opt = trained()
    checkpoint.save(tmp_path / "c", m, opt)
    wider = nn.Sequential(nn.Linear(6, 11), nn.Tanh(), nn.Linear(11, 4))
    with pytest.raises(CheckpointError, match=r"0\.weight has shape \(9, 6\) in the checkpoint but \(11, 6\) in this"):
        checkpoint.load(tmp_path / "c", wider)
    deeper = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"has no model\.3\.weight"):
        checkpoint.load(tmp_path / "c", deeper)
    with pytest.raises(CheckpointError, match="holds no optimizer state"):
        checkpoint.save(tmp_path / "model_only", m)
        checkpoint.load(tmp_path / "model_only", m, opt)


def test_missing_and_truncated_checkpoints_are_checkpoint_errors(tmp_path):
    m, opt = trained()
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        checkpoint.load(tmp_path / "nowhere", m, opt)
    checkpoint.save(tmp_path / "c", m, opt)
    data = next((tmp_path / "c").glob("*.distcp"))
    os.truncate(data, data.stat().st_size // 2)
    with pytest.raises(CheckpointError, match="cannot be read"):
        checkpoint.load(tmp_path / "c", m, opt)
    (tmp_path / "c" / ".metadata").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(CheckpointError, match="not a readable checkpoint index"):
        checkpoint.load(tmp_path / "c", m, opt)
    (tmp_path / "c" / checkpoint.MANIFEST).write_text("{")
    with pytest.raises(CheckpointError, match="cannot read checkpoint.json"):
        checkpoint.load(tmp_path / "c", m, opt)


class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_loading_never_unpickles_anything_but_the_checkpoint_index(tmp_path):
    m, opt = trained()
    checkpoint.save(tmp_path / "c", m, opt)
    payload = _Payload()
    payload.marker = tmp_path / "code-ran"
    (tmp_path / "c" / ".metadata").write_bytes(pickle.dumps(payload))
    with pytest.raises(CheckpointError, match="posix.system is not part of a checkpoint index|system is not part"):
        checkpoint.load(tmp_path / "c", m, opt)
    assert not payload.marker.exists()
    # and what a checkpoint holds besides tensors is JSON: DCP got no object to pickle
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    checkpoint.save(tmp_path / "d", m, opt)
    meta = checkpoint.SafeFileSystemReader(str(tmp_path / "d")).read_metadata()
    assert not [k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]
