"""Reading a DCP checkpoint without unpickling anything but DCP's own metadata.

DCP keeps its index (`.metadata`) as a pickle and reads it with `pickle.load`, which would run
whatever a crafted file asks for. Our reader unpickles only the classes that index is made of;
anything else is refused. (Tensor data is read by DCP as raw bytes; our checkpoints hold no
pickled objects besides that index: everything else is JSON.)
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from hyperparallel.errors import CheckpointError

_DTYPES = {"float64", "float32", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
           "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu", "complex64", "complex128"}
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                              "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                              "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"} | _DTYPES,
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose metadata is unpickled from an allowlist of DCP's classes only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        cached = getattr(self, "_hp_metadata", None)
        if cached is not None:  # dcp.load reads it again after the caller's checks
            return cached
        path = Path(self.path) / ".metadata" if kwargs.get("rank") is None else None
        if path is None:
            raise CheckpointError(f"checkpoint {self.path}: per-rank metadata files are not supported")
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except FileNotFoundError:
            raise CheckpointError(f"checkpoint {self.path} has no .metadata (not a complete checkpoint)") from None
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError) as error:
            raise CheckpointError(f"checkpoint {self.path}: .metadata is not a readable checkpoint index ({error})") \
                from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"checkpoint {self.path}: .metadata holds {type(metadata).__name__}, not an index")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._hp_metadata = metadata
        return metadata
