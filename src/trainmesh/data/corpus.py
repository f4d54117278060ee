"""Corpora as memory-mapped token files, tokenised once and cached.

Sources (`data.source`):
- `embedded`: the Python standard library's own source, present on every machine with Python —
  real text, nothing to download.
- a text file: tokenised with `data.tokenizer`.
- a folder of token shards: `*train*.bin`/`*val*.bin` (raw uint16, nanoGPT style) or `.npy`
  (build-nanogpt style); used in place, no copy.

Text is split into train/val by 64 KiB chunk (every k-th chunk to val), so validation text comes from
all over the corpus. The cache folder is keyed by a hash of the inputs and committed by an atomic rename,
so concurrent builders (one per node) cannot leave a half-written cache behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainmesh.data.tokenizer import Tokenizer
from trainmesh.runtime.logging import get_logger

log = get_logger(__name__)

CHUNK_BYTES = 64 * 1024
TOKEN_DTYPE = np.uint16
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass(frozen=True)
class TokenCorpus:
    """Where the train and val token shards of a corpus live."""

    train: tuple[Path, ...]
    val: tuple[Path, ...]
    vocab_size: int
    """From the tokenizer; 0 for pre-tokenised shards (model.vocab_size must then be set)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "trainmesh"


def embedded_files(max_bytes: int) -> list[Path]:
    """The standard library's .py files in a fixed order, up to `max_bytes` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in sorted(root.rglob("*.py")):
        if _SKIP_DIRS.intersection(path.relative_to(root).parts[:-1]):
            continue
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        files.append(path)
        total += size
    if not files:
        raise RuntimeError(f"no Python source found under {root} for the embedded corpus")
    return files


def shard_corpus(folder: Path) -> TokenCorpus:
    """A folder of pre-tokenised shards; names containing 'train' / 'val' tell the splits apart."""
    shards = sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".npy"))
    train = tuple(p for p in shards if "train" in p.name)
    val = tuple(p for p in shards if "val" in p.name)
    if not train or not val:
        raise ValueError(
            f"data.source={str(folder)!r}: a shard folder needs *train*.bin|.npy and *val*.bin|.npy files; "
            f"found {[p.name for p in shards] or 'none'}"
        )
    return TokenCorpus(train, val, vocab_size=0)  # unknown: shards carry no tokenizer, the config says


def text_corpus(files: list[Path], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path) -> TokenCorpus:
    """Tokenise text files once into cache_dir/<hash>/{train,val}.bin and return the cached shards."""
    key = _cache_key(files, tokenizer, val_fraction)
    folder = cache_dir / key
    if not (folder / "meta.json").is_file():
        _build_cache(files, tokenizer, val_fraction, folder)
    return TokenCorpus((folder / "train.bin",), (folder / "val.bin",), tokenizer.vocab_size)


def load_tokens(path: Path) -> np.ndarray:
    """Memory-map one shard (no read into RAM)."""
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r")
    return np.memmap(path, dtype=TOKEN_DTYPE, mode="r")


def _cache_key(files: list[Path], tokenizer: Tokenizer, val_fraction: float) -> str:
    h = hashlib.sha256(f"v1|{tokenizer.name}|{tokenizer.vocab_size}|{val_fraction}".encode())
    for path in files:
        stat = path.stat()
        h.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _build_cache(files: list[Path], tokenizer: Tokenizer, val_fraction: float, folder: Path) -> None:
    text = "\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)
    tokens = tokenizer.encode(text)
    if int(tokens.max(initial=0)) > np.iinfo(TOKEN_DTYPE).max:
        raise ValueError(f"tokenizer {tokenizer.name!r} emits ids above {np.iinfo(TOKEN_DTYPE).max}")
    chunks = [tokens[i : i + CHUNK_BYTES] for i in range(0, len(tokens), CHUNK_BYTES)]
    every = max(2, round(1 / val_fraction))
    val = [c for i, c in enumerate(chunks) if i % every == every - 1]
    train = [c for i, c in enumerate(chunks) if i % every != every - 1]
    if not val:  # tiny corpus: hold out its tail
        split = max(1, int(len(tokens) * (1 - val_fraction)))
        train, val = [tokens[:split]], [tokens[split:]]
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    np.concatenate(train).astype(TOKEN_DTYPE).tofile(staging / "train.bin")
    np.concatenate(val).astype(TOKEN_DTYPE).tofile(staging / "val.bin")
    meta = {"tokenizer": tokenizer.name, "files": len(files), "tokens": len(tokens)}
    (staging / "meta.json").write_text(json.dumps(meta))
    try:
        staging.rename(folder)  # atomic commit; loses the race harmlessly if another builder won
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("tokenised %d file(s), %s tokens -> %s", len(files), f"{len(tokens):,}", folder)
