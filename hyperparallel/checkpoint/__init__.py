"""Checkpoints of (sharded) training state through torch.distributed.checkpoint: save (now or in
the background), load into any layout, and export to Hugging Face."""

from hyperparallel.checkpoint.export import export_hf, model_from_checkpoint
from hyperparallel.checkpoint.io import MANIFEST, complete_checkpoints, load, read_manifest, save
from hyperparallel.checkpoint.model_card import ModelCard
from hyperparallel.checkpoint.pending import PendingSave, async_save
from hyperparallel.checkpoint.sharded import Chunk, ShardedLoadPlanner, ShardedSavePlanner, shard_chunks
from hyperparallel.checkpoint.storage import SafeFileSystemReader

__all__ = [
    "MANIFEST",
    "Chunk",
    "ModelCard",
    "PendingSave",
    "SafeFileSystemReader",
    "ShardedLoadPlanner",
    "ShardedSavePlanner",
    "async_save",
    "complete_checkpoints",
    "export_hf",
    "load",
    "model_from_checkpoint",
    "read_manifest",
    "save",
    "shard_chunks",
]
