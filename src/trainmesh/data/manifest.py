"""manifest.json: what a folder of prepared token shards holds and how it was made; written last, so a folder with one
is complete.

Details: docs/internals.md#datamanifestpy
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainmesh.core.files import JsonFileError, is_plain_name, read_json
from trainmesh.data.shards import HEADER_BYTES, MAGIC, VERSION, BadShardError, ShardInfo

MANIFEST = "manifest.json"
FORMAT = "trainmesh-tokens"
FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"[^/]+_(?:train|val)_\d{6}\.bin")  # shards.py ShardWriter's names
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_MANIFEST_BYTES = 256 << 20
"""The largest manifest.json read (read whole): about 250 bytes an input, a million inputs; the bound keeps a
planted huge file from filling the memory."""


@dataclass(frozen=True)
class TokenizerInfo:
    name: str
    vocab_size: int
    eot: int | None


@dataclass(frozen=True)
class SplitInfo:
    documents: int
    """documents that start in this split (a split boundary may fall inside a document)"""
    tokens: int
    shards: tuple[ShardInfo, ...]


@dataclass(frozen=True)
class SourceInfo:
    path: str
    kind: str
    bytes: int
    sha256: str
    """of the file; of a saved dataset's folder: of its files' "<sha256>  <relative path>" lines, sorted"""


@dataclass(frozen=True)
class Manifest:
    tokenizer: TokenizerInfo
    train: SplitInfo
    val: SplitInfo
    sources: tuple[SourceInfo, ...]
    options: dict[str, Any]
    trainmesh_version: str

    def to_json(self) -> str:
        body = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "trainmesh_version": self.trainmesh_version,
            "shard_layout": {"layout": "llm.c", "magic": MAGIC, "version": VERSION, "header_bytes": HEADER_BYTES},
            "tokenizer": asdict(self.tokenizer),
            "documents": self.train.documents + self.val.documents,
            "tokens": self.train.tokens + self.val.tokens,
            "splits": {"train": asdict(self.train), "val": asdict(self.val)},
            "sources": [asdict(s) for s in self.sources],
            "options": self.options,
        }
        return json.dumps(body, indent=2) + "\n"


def read_manifest(folder: Path) -> Manifest | None:
    """The manifest of a prepared folder; None when it has none (shards from elsewhere)."""
    path = folder / MANIFEST
    if not os.path.lexists(path):  # anything else there (a FIFO, a symlink) is refused by read_json
        return None
    try:
        body = read_json(path, MAX_MANIFEST_BYTES)
        if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format {body.get('format')!r} version {body.get('format_version')!r}")
        return Manifest(
            tokenizer=_tokenizer(body["tokenizer"]),
            train=_split(body["splits"]["train"]),
            val=_split(body["splits"]["val"]),
            sources=tuple(SourceInfo(**s) for s in body["sources"]),
            options=dict(body["options"]),
            trainmesh_version=str(body["trainmesh_version"]),
        )
    except JsonFileError as e:
        problem = str(e)
    except (ValueError, KeyError, TypeError, AttributeError) as e:  # any JSON at all
        problem = f"{path} is not a manifest this trainmesh reads ({FORMAT} version {FORMAT_VERSION}): {e}"
    raise BadShardError(
        f"{problem}. Fix: prepare the folder again with trainmesh data prepare (or remove manifest.json to read the "
        "shards by their names, with --model.vocab_size set)."
    )


def prepared_files(folder: Path) -> set[str] | None:
    """The names of the files `trainmesh data prepare` writes into `folder`: manifest.json and the shards it
    lists (named as shards are: a hand-edited manifest cannot make `--force` take other files); None when
    `folder` holds no manifest.json of trainmesh's format (of any version): not prepare's."""
    try:
        body = read_json(folder / MANIFEST, MAX_MANIFEST_BYTES)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            return None
        listed = {str(shard["file"]) for split in body["splits"].values() for shard in split["shards"]}
    except (JsonFileError, KeyError, TypeError, AttributeError):  # none, unreadable, another layout
        return None
    return {MANIFEST, *(name for name in listed if SHARD_NAME.fullmatch(name))}


def shard_path(folder: Path, name: str) -> Path:
    """`folder/name` for a shard the manifest lists, refused unless it is a file inside `folder`: `name` a plain
    file name (not absolute, `..`, in a subfolder or holding a NUL byte), and not a symlink to somewhere else. A
    hand-edited or planted manifest could otherwise make training read any file on the machine."""
    path = folder / name
    try:
        inside = is_plain_name(name) and path.resolve().is_relative_to(folder.resolve())
    except OSError as e:  # a name too long, a symlink loop, ...
        raise BadShardError(f"token shard {path}, which {folder / MANIFEST} lists, cannot be read: {e}") from None
    if not inside:
        raise BadShardError(
            f"{folder / MANIFEST} lists token shard {name!r}, which is not a file inside {folder} (an absolute path, "
            "'..', a subfolder, a NUL byte, or a symlink out of it): trainmesh reads only the folder's own shards. "
            "Fix: prepare the folder again (trainmesh data prepare), or copy the shards into it."
        )
    return path


def _split(body: dict[str, Any]) -> SplitInfo:
    return SplitInfo(int(body["documents"]), int(body["tokens"]), tuple(_shard(s) for s in body["shards"]))


# The entries' types are checked as they are read, so that a damaged entry is refused as such rather than
# compared or computed with later as a count, digest or vocabulary of another type.


def _tokenizer(entry: dict[str, Any]) -> TokenizerInfo:
    info = TokenizerInfo(**entry)
    eot_ok = info.eot is None or _int_from(info.eot, 0)
    if not (isinstance(info.name, str) and _int_from(info.vocab_size, 1) and eot_ok):
        raise ValueError(f"tokenizer {str(entry)[:200]} is not {{name: <name>, vocab_size: <count>, eot: <id>|null}}")
    return info


def _shard(entry: dict[str, Any]) -> ShardInfo:
    shard = ShardInfo(**entry)
    sha_ok = isinstance(shard.sha256, str) and _SHA256.fullmatch(shard.sha256)
    if not (isinstance(shard.file, str) and _int_from(shard.tokens, 1) and sha_ok):
        raise ValueError(f"shard entry {str(entry)[:200]} is not {{file: <name>, tokens: <count>, sha256: <hex>}}")
    return shard


def _int_from(value: object, least: int) -> bool:
    """Whether `value` is an int (a JSON number without a fraction, not a bool) of at least `least`."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least
