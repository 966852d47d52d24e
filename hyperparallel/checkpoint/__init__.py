"""Checkpoints of (sharded) training state through torch.distributed.checkpoint: save (now or in
the background), load into any layout, and export to Hugging Face (streamed); and Hugging Face
safetensors directories read block by block into any layout."""

from hyperparallel.lazy_exports import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(__name__, {
    "export": ("export_hf", "model_from_checkpoint"),
    "hf_files": ("FileTensor", "HFReadPlan", "plan_hf_read"),
    "io": ("MANIFEST", "checkpoint_in", "complete_checkpoints", "load", "read_manifest", "save"),
    "model_card": ("ModelCard",),
    "pending": ("PendingSave", "async_save"),
    "safetensors_stream": ("SafetensorsWriter", "TensorSpec"),
    "sharded": ("Chunk", "ShardedLoadPlanner", "ShardedSavePlanner", "shard_chunks"),
    "storage": ("SafeFileSystemReader",),
})
