"""DCP checkpoints (`.metadata` + `__<rank>_<n>.distcp`) read as data: nothing in them runs code.

torch reads a DCP checkpoint with plain `pickle.load` twice over: the whole `.metadata` file, and every non-tensor
entry of the state (the optimizer's param_groups: lr, betas, ...) with `torch.load(weights_only=False)`. A crafted
checkpoint directory therefore runs any code it likes on load. Here both go through readers that accept only what a
checkpoint holds:

    dcp.load(state, storage_reader=reader(directory), planner=planner())

- `.metadata` is unpickled with an allow-list of the 15 globals a real one names (DCP's metadata dataclasses, its
  `_StorageInfo`, `torch.Size`, dtypes, the layout helper, the memory-format enum, `pathlib` paths); any other global
  is refused before it is looked up. The result is then checked: a `Metadata` whose storage entries name only shard
  files of this directory (`__<rank>_<n>.distcp`, no path) at non-negative offsets.
- Non-tensor entries load with `torch.load(weights_only=True)` (plain numbers, strings, tuples, dicts).
- Tensors were already read with `weights_only=True` by torch.

A refusal is a `CheckpointRefused` (a ConfigError: one line naming the file and the global or entry).
"""

from __future__ import annotations

import io
import pickle
import re
from pathlib import Path

import torch

from llmrl.errors import ConfigError

METADATA_MODULE = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS = {
    *((METADATA_MODULE, name) for name in (
        "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # looks a layout up by its name among torch's layouts
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
SHARD_FILE = re.compile(r"__\d+_\d+\.distcp")


class CheckpointRefused(ConfigError):
    """A DCP file that holds something a checkpoint does not (code, a path outside its directory)."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise CheckpointRefused(f"checkpoint file {self.path} names {module}.{name}, which a DCP checkpoint's metadata "
                                "never holds: refusing to load it (it could run code)")


def read_metadata(path: Path):
    """The `Metadata` of a DCP checkpoint's `.metadata` file, unpickled with the allow-list and checked."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except CheckpointRefused:
        raise
    except Exception as e:  # noqa: BLE001 - truncated or garbled: any unpickling error
        raise CheckpointRefused(f"checkpoint file {path} is not a DCP metadata file ({type(e).__name__}: "
                                f"{str(e).strip()[:200]})") from None
    if type(metadata) is not Metadata:
        raise CheckpointRefused(f"checkpoint file {path} holds a {type(metadata).__name__}, not DCP Metadata")
    for key, entry in (metadata.state_dict_metadata or {}).items():
        if not isinstance(key, str) or type(entry) not in (TensorStorageMetadata, BytesStorageMetadata):
            raise CheckpointRefused(f"checkpoint file {path}: entry {key!r} is not tensor or bytes metadata")
    for entry in (metadata.storage_data or {}).values():
        name = getattr(entry, "relative_path", None)
        if (type(entry) is not _StorageInfo or not isinstance(name, str) or not SHARD_FILE.fullmatch(name)
                or not all(isinstance(v, int) and v >= 0 for v in (entry.offset, entry.length))):
            raise CheckpointRefused(f"checkpoint file {path}: a storage entry names {name!r}, not a shard file of its "
                                    "own directory at a valid offset")
    return metadata


def reader(directory: str | Path):
    """A FileSystemReader of `directory` whose `.metadata` is read by `read_metadata`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataAsData(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            metadata = read_metadata(Path(self.path) / ".metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return MetadataAsData(directory)


def planner():
    """The default load planner, but non-tensor entries are read with `torch.load(weights_only=True)`."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class BytesAsData(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:
            try:
                obj = torch.load(value, weights_only=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError) as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointRefused(f"checkpoint entry {read_item.dest_index.fqn} is not plain data, refusing to "
                                        f"load it ({first[:200]})") from None
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return BytesAsData()


def first_failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (which wraps every rank's), else `e`."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        found = failures[min(failures)]
        return found[0] if isinstance(found, tuple) else found
    return e


def failure_line(e: BaseException) -> str:
    """One line for a failed DCP save or load: the ranks that failed and the first one's error."""
    cause = first_failure(e)
    ranks = sorted(getattr(e, "failures", None) or {})
    text = (cause.strerror if isinstance(cause, OSError) and cause.strerror else str(cause)).strip()
    text = text.splitlines()[0] if text else type(cause).__name__
    return (f"rank {', '.join(map(str, ranks))}: " if ranks else "") + text[:300]
