"""Token shards on disk: llm.c's `.bin` layout (written and read), raw uint16 `.bin` and `.npy` (read); a file whose
header and size disagree is refused.

Details: docs/internals.md#datashardspy
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from trainmesh.core.errors import UserError

MAGIC = 20240520
VERSION = 1
LLAMA3_MAGIC = 20240801  # llm.c's "llama-3" layout: version 7, uint32 tokens (not read)
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
TOKEN_DTYPE = np.dtype("<u2")
MAX_SHARD_TOKENS = 2**31 - 1  # the header's int32 count


class BadShardError(UserError, ValueError):
    """A token shard that cannot be read as one, or holds ids outside the vocabulary."""


@dataclass(frozen=True)
class ShardInfo:
    """One written shard, as the manifest records it."""

    file: str
    tokens: int
    sha256: str


def header(count: int) -> bytes:
    """llm.c's 1024-byte header for a shard of `count` uint16 tokens."""
    assert 0 <= count <= MAX_SHARD_TOKENS, count
    ints = np.zeros(HEADER_INTS, dtype="<i4")
    ints[0], ints[1], ints[2] = MAGIC, VERSION, count
    return ints.tobytes()


def llmc_token_count(path: Path) -> int | None:
    """The token count of an llm.c shard after checking its header against the file's size; None: the file
    does not start with llm.c's magic (a raw shard)."""
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER_BYTES)
        size = path.stat().st_size
    except OSError as e:
        raise BadShardError(f"token shard {path} cannot be read: {e.strerror}") from None
    magic = int(np.frombuffer(raw[:4], dtype="<i4")[0]) if len(raw) >= 4 else None
    if magic == LLAMA3_MAGIC:
        version = int(np.frombuffer(raw[4:8], dtype="<i4")[0]) if len(raw) >= 8 else "missing"
        raise BadShardError(
            f"token shard {path} is an llm.c Llama-3 shard (magic {LLAMA3_MAGIC}, version {version}): uint32 "
            "tokens, not supported; trainmesh reads llm.c's GPT-2 layout (uint16 tokens). Fix: re-prepare the "
            "text with trainmesh data prepare (a tokenizer of at most 65,536 ids), or use llm.c's GPT-2 shards."
        )
    if magic != MAGIC:
        return None
    if len(raw) < HEADER_BYTES:
        raise BadShardError(
            f"token shard {path} starts with llm.c's magic {MAGIC} but has {size:,} bytes, less than its "
            f"{HEADER_BYTES}-byte header: truncated. Fix: copy or prepare it again (trainmesh data prepare)."
        )
    version, count = (int(v) for v in np.frombuffer(raw[4:12], dtype="<i4"))
    if version != VERSION:
        raise BadShardError(
            f"token shard {path} is an llm.c shard of version {version}; trainmesh reads version {VERSION} "
            "(uint16 tokens). Fix: prepare the data again with trainmesh data prepare."
        )
    expected = HEADER_BYTES + count * TOKEN_DTYPE.itemsize
    if count < 0 or size != expected:
        raise BadShardError(
            f"token shard {path} has {size:,} bytes, but its llm.c header says {count:,} tokens, which take "
            f"{expected:,} bytes: truncated or corrupted. Fix: copy or prepare it again (trainmesh data prepare)."
        )
    if count == 0:
        raise BadShardError(f"token shard {path} is an llm.c shard of 0 tokens: nothing to train on")
    return count


def load_tokens(path: Path) -> np.ndarray:
    """Memory-map one shard (no read into RAM). A prepared folder's shards are checked against its manifest
    before they are loaded (data/corpus.py `_prepared_corpus`), so a damaged magic there is refused rather
    than read as raw tokens."""
    if path.suffix == ".npy":
        return _load_npy(path)
    count = llmc_token_count(path)
    if count is not None:
        return np.memmap(path, dtype=TOKEN_DTYPE, mode="r", offset=HEADER_BYTES, shape=(count,))
    size = path.stat().st_size
    if size == 0:
        raise BadShardError(f"token shard {path} is empty (0 bytes)")
    if size % TOKEN_DTYPE.itemsize:
        raise BadShardError(
            f"token shard {path} has {size:,} bytes, not a whole number of {TOKEN_DTYPE.itemsize}-byte "
            "(uint16) token ids: truncated, or not a token shard"
        )
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def _load_npy(path: Path) -> np.ndarray:
    try:
        tokens = np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise BadShardError(f"token shard {path} is not a readable .npy array: {e}") from None
    if tokens.ndim != 1 or tokens.dtype.kind not in "ui":
        raise BadShardError(f"token shard {path} holds a {tokens.dtype} array of shape {tokens.shape}, not token ids")
    if not len(tokens):
        raise BadShardError(f"token shard {path} is empty")
    return tokens


class ShardWriter:
    """Appends tokens to `<prefix>_<split>_000000.bin`, `..._000001.bin`, ... of `shard_tokens` tokens each.

    A shard is written with a zero count in its header, which is filled in when the shard is full (or the
    writer is closed); its SHA-256 is taken then, by reading it back (the header comes first, so the hash
    cannot be computed as the tokens stream past). Write into a staging folder: a shard is complete only
    once the folder is committed."""

    def __init__(self, folder: Path, prefix: str, split: str, shard_tokens: int) -> None:
        assert 0 < shard_tokens <= MAX_SHARD_TOKENS, shard_tokens
        self.folder, self.prefix, self.split, self.shard_tokens = folder, prefix, split, shard_tokens
        self.shards: list[ShardInfo] = []
        self.tokens = 0
        self._file: BinaryIO | None = None
        self._in_file = 0

    def write(self, tokens: np.ndarray) -> None:
        assert tokens.dtype == np.uint16, tokens.dtype
        while len(tokens):
            if self._file is None:
                self._open()
            assert self._file is not None
            take = tokens[: self.shard_tokens - self._in_file]
            self._file.write(take.astype(TOKEN_DTYPE, copy=False).tobytes())
            self._in_file += len(take)
            self.tokens += len(take)
            tokens = tokens[len(take) :]
            if self._in_file == self.shard_tokens:
                self._finish()

    def close(self) -> list[ShardInfo]:
        if self._file is not None:
            self._finish()
        return self.shards

    def _path(self) -> Path:
        return self.folder / f"{self.prefix}_{self.split}_{len(self.shards):06d}.bin"

    def _open(self) -> None:
        self._file = self._path().open("xb")
        self._file.write(header(0))
        self._in_file = 0

    def _finish(self) -> None:
        assert self._file is not None
        f, self._file = self._file, None
        f.seek(0)
        f.write(header(self._in_file))
        f.flush()
        os.fsync(f.fileno())
        f.close()
        path = self._path()
        with path.open("rb") as done:
            digest = hashlib.file_digest(done, "sha256").hexdigest()
        self.shards.append(ShardInfo(path.name, self._in_file, digest))
