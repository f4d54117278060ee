"""manifest.json: what a folder of prepared token shards holds and how it was made.

`trainmesh data prepare` writes it last, into the staging folder that is then renamed into place, so a
folder with a manifest is complete. It records the tokenizer (which the GPT recipe takes the vocabulary size
from, and checks `data.tokenizer` against), every shard with its token count and SHA-256, the documents and
tokens of each split, every input with its size and SHA-256, the options, and the trainmesh version.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainmesh.data.shards import HEADER_BYTES, MAGIC, VERSION, BadShardError, ShardInfo

MANIFEST = "manifest.json"
FORMAT = "trainmesh-tokens"
FORMAT_VERSION = 1
SHARD_NAME = re.compile(r"[^/]+_(?:train|val)_\d{6}\.bin")  # shards.py ShardWriter's names


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
    if not path.is_file():
        return None
    try:
        body = json.loads(path.read_text())
        if body.get("format") != FORMAT or body.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format {body.get('format')!r} version {body.get('format_version')!r}")
        return Manifest(
            tokenizer=TokenizerInfo(**body["tokenizer"]),
            train=_split(body["splits"]["train"]),
            val=_split(body["splits"]["val"]),
            sources=tuple(SourceInfo(**s) for s in body["sources"]),
            options=dict(body["options"]),
            trainmesh_version=str(body["trainmesh_version"]),
        )
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BadShardError(
            f"{path} is not a manifest this trainmesh reads ({FORMAT} version {FORMAT_VERSION}): {e}. "
            "Fix: prepare the folder again with trainmesh data prepare (or remove manifest.json to read the "
            "shards by their names, with --model.vocab_size set)."
        ) from None


def prepared_files(folder: Path) -> set[str] | None:
    """The names of the files `trainmesh data prepare` writes into `folder`: manifest.json and the shards it
    lists (named as shards are: a hand-edited manifest cannot make `--force` take other files); None when
    `folder` holds no manifest.json of trainmesh's format (of any version): not prepare's."""
    try:
        body = json.loads((folder / MANIFEST).read_text())
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            return None
        listed = {str(shard["file"]) for split in body["splits"].values() for shard in split["shards"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, unreadable, or another layout
        return None
    return {MANIFEST, *(name for name in listed if SHARD_NAME.fullmatch(name))}


def _split(body: dict[str, Any]) -> SplitInfo:
    shards = tuple(ShardInfo(**s) for s in body["shards"])
    return SplitInfo(int(body["documents"]), int(body["tokens"]), shards)
