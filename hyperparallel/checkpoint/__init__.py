"""Checkpoints of (sharded) training state through torch.distributed.checkpoint: save, load into
any layout, and export to Hugging Face."""

from hyperparallel.checkpoint.export import export_hf
from hyperparallel.checkpoint.io import MANIFEST, complete_checkpoints, load, read_manifest, save
from hyperparallel.checkpoint.sharded import as_sharded, load_planner, save_planner, unwrap, wrap_state
from hyperparallel.checkpoint.storage import SafeFileSystemReader

__all__ = [
    "MANIFEST",
    "SafeFileSystemReader",
    "as_sharded",
    "complete_checkpoints",
    "export_hf",
    "load",
    "load_planner",
    "read_manifest",
    "save",
    "save_planner",
    "unwrap",
    "wrap_state",
]
