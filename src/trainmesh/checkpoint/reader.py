"""Reading a checkpoint folder that may come from anyone, without letting it run code: `SafeReader` and
`SafeLoadPlanner`, which every `dcp.load` in trainmesh uses.

Details: docs/internals.md#checkpointreaderpy
"""

from __future__ import annotations

import io
import itertools
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from trainmesh.checkpoint.rank_files import UntrustedCheckpointError

METADATA = ".metadata"
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_ALLOWED: frozenset[tuple[str, str]] = frozenset(
    {
        *(
            (_DCP_METADATA, name)
            for name in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # name -> torch.layout
        ("collections", "OrderedDict"),
        # StorageMeta.checkpoint_id: the path it was saved to (pathlib is a package from Python 3.13)
        *((module, cls) for module in ("pathlib", "pathlib._local") for cls in ("PosixPath", "PurePosixPath")),
    }
)


_BUILDABLE = (
    Metadata,
    StorageMeta,
    MetadataIndex,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    _StorageInfo,
)


_PICKLE_BUILD: Callable[[Any], None] = pickle._Unpickler.dispatch[pickle.BUILD[0]]


class _MetadataUnpickler(pickle._Unpickler):
    """The allow-listing unpickler. It is pickle's Python implementation, whose opcodes can be checked one
    by one: BUILD sets attributes on whatever object lies on the stack, and an allowed *class* gets there
    as easily as an instance (`setattr(PosixPath, "_str", "/elsewhere")` would redirect every path of the
    process, even if the file were refused afterwards). So BUILD is accepted on instances of the metadata
    classes only."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # pickle's own (undeclared in typeshed)

    def __init__(self, file: io.BufferedIOBase, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise self._refuse(f"tries to load {module}.{name}, which DCP metadata never holds")

    def persistent_load(self, pid: Any) -> Any:
        raise self._refuse(f"holds a persistent reference ({type(pid).__name__}), which DCP metadata never does")

    def load_build(self) -> None:
        target = self.stack[-2]  # the stack holds (..., object, state)
        if type(target) not in _BUILDABLE:  # a class, a function, or an instance of another type
            raise self._refuse(f"tries to set the attributes of {target!r}, which DCP metadata never does")
        _PICKLE_BUILD(self)

    dispatch[pickle.BUILD[0]] = load_build

    def _refuse(self, what: str) -> UntrustedCheckpointError:
        return UntrustedCheckpointError(
            f"{self.path} {what}: refusing this untrusted checkpoint (nothing in it was loaded or run). Fix: "
            "resume or read only checkpoints from a source you trust; trainmesh writes none like this."
        )


def read_metadata(folder: Path) -> Metadata:
    """DCP's metadata of the checkpoint in `folder`, unpickled with the allow-list and checked: every
    shard it names is a file in `folder` itself."""
    path = folder / METADATA
    try:
        with path.open("rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except UntrustedCheckpointError:
        raise
    except Exception as e:  # truncated or garbled: any error the pickle machinery raises
        raise UntrustedCheckpointError(f"{path} is not DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise UntrustedCheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata")
    storage = metadata.storage_data
    if not isinstance(storage, dict) or not all(isinstance(info, _StorageInfo) for info in storage.values()):
        raise UntrustedCheckpointError(f"{path}: its storage table is not DCP's")
    for info in storage.values():
        name = info.relative_path
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)):
            raise UntrustedCheckpointError(f"{path}: a shard slice at {info.offset!r}+{info.length!r}; refusing it")
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", "..") or "\\" in name:
            raise UntrustedCheckpointError(f"{path} names a shard {name!r} outside the checkpoint; refusing it")
        shard = folder / name
        if shard.is_symlink() or not shard.is_file():
            raise UntrustedCheckpointError(f"{path} names {shard}, which is not a file of the checkpoint")
    return metadata


def saved_tensors(folder: Path) -> dict[str, TensorStorageMetadata]:
    """Name -> shape, dtype of every tensor in a checkpoint ("model.*", "optim.*"), from its metadata."""
    return {k: v for k, v in read_metadata(folder).state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}


class SafeReader(FileSystemReader):
    """DCP's file-system reader, reading `.metadata` through `read_metadata`."""

    def __init__(self, folder: Path) -> None:
        super().__init__(str(folder))
        self.folder = folder

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None and Path(checkpoint_id) != self.folder:  # it reads `folder`, checked, only
            raise ValueError(f"SafeReader of {self.folder} asked to read {checkpoint_id}")
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:  # per-rank metadata files: trainmesh never writes them
            raise UntrustedCheckpointError(f"{self.folder}: per-rank metadata was asked for; trainmesh has none")
        metadata = read_metadata(self.folder)
        storage_meta = metadata.storage_meta if isinstance(metadata.storage_meta, StorageMeta) else StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader.read_metadata does
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, loading non-tensor values with `weights_only=True`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UntrustedCheckpointError(
                f"the value {fqn!r} is a pickle that only code could build, refused ({str(e).splitlines()[0]})"
            ) from None
        if self.flatten_state_dict:
            set_path(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def set_path(root: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """root[path[0]][path[1]]... = value, creating dicts (and lists, for integer keys) on the way."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        if isinstance(node, list):
            assert isinstance(key, int)
            node.extend([None] * (key + 1 - len(node)))
        elif key not in node:
            node[key] = None
        if node[key] is None:
            node[key] = [] if isinstance(following, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        assert isinstance(last, int)
        node.extend([None] * (last + 1 - len(node)))
    node[last] = value
