"""Corpora as memory-mapped token files, tokenised once and cached.

Sources (`data.source`):
- `embedded`: the Python standard library's own source, present on every machine with Python —
  real text, nothing to download.
- a text file: tokenised with `data.tokenizer`.
- a folder of token shards: `*train*.bin`/`*val*.bin` (llm.c's layout with its 1024-byte header, or raw
  uint16, nanoGPT style) or `.npy` (build-nanogpt style); used in place, no copy (data/shards.py).

Text is split into train/val by 64 KiB chunk (every k-th chunk to val), so validation text comes from
all over the corpus. The cache folder is keyed by a hash of the inputs and committed by an atomic rename,
so concurrent builders (one per node) cannot leave a half-written cache behind.

Shards are checked before training: an empty or odd-sized one is refused naming the file, and
`check_token_range` refuses token ids outside the model's vocabulary once, at the start (on a GPU such an
id is a device-side assert in the embedding, far from its cause). The range of ids of each shard is cached
beside the tokenised corpora, keyed by the shard's path, size and modification time.
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

from trainmesh.core.logging import get_logger
from trainmesh.data.shards import BadShardError, load_tokens
from trainmesh.data.tokenizer import Tokenizer

log = get_logger(__name__)

CHUNK_BYTES = 64 * 1024
TOKEN_DTYPE = np.uint16
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
__all__ = ["BadShardError", "TokenCorpus", "check_token_range", "embedded_files", "load_tokens", "shard_corpus"]


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
        raise BadShardError(
            f"data.source={str(folder)!r}: a shard folder needs *train*.bin|.npy and *val*.bin|.npy files; "
            f"found {[p.name for p in shards] or 'none'}. Fix: --data.source=<a folder with both, or a text file>."
        )
    return TokenCorpus(train, val, vocab_size=0)  # unknown: shards carry no tokenizer, the config says


def text_corpus(files: list[Path], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path) -> TokenCorpus:
    """Tokenise text files once into cache_dir/<hash>/{train,val}.bin and return the cached shards."""
    key = _cache_key(files, tokenizer, val_fraction)
    folder = cache_dir / key
    if not (folder / "meta.json").is_file():
        _build_cache(files, tokenizer, val_fraction, folder)
    return TokenCorpus((folder / "train.bin",), (folder / "val.bin",), tokenizer.vocab_size)


def check_token_range(corpus: TokenCorpus, vocab_size: int, cache_dir: Path) -> None:
    """Refuse a corpus with a token id outside 0..`vocab_size`-1, naming the shard and the fix."""
    for path in (*corpus.train, *corpus.val):
        lowest, highest = _token_range(path, cache_dir)
        if lowest < 0:
            raise BadShardError(f"token shard {path} holds a negative token id ({lowest}): not token ids")
        if highest >= vocab_size:
            raise BadShardError(
                f"token shard {path} holds token id {highest}, outside the model's vocabulary of {vocab_size} "
                f"(model.vocab_size). Fix: --model.vocab_size={highest + 1} or more (a multiple of 64 is fastest, "
                "e.g. 50304 for GPT-2's tokenizer), or re-tokenise the data with data.tokenizer."
            )


def _token_range(path: Path, cache_dir: Path) -> tuple[int, int]:
    """The smallest and largest token id in a shard, read in chunks once and then cached."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    cached = cache_dir / "shard-stats" / f"{key}.json"
    try:
        record = json.loads(cached.read_text())
        return int(record["min_token"]), int(record["max_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tokens = load_tokens(path)
    step = 1 << 26
    chunks = [tokens[i : i + step] for i in range(0, len(tokens), step)]
    lowest, highest = min(int(c.min()) for c in chunks), max(int(c.max()) for c in chunks)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
        tmp.write_text(json.dumps({"path": str(path), "min_token": lowest, "max_token": highest}))
        tmp.replace(cached)
    except OSError as e:  # a read-only cache costs a re-scan next time, nothing more
        log.debug("could not cache the token range of %s: %s", path, e)
    return lowest, highest


def _cache_key(files: list[Path], tokenizer: Tokenizer, val_fraction: float) -> str:
    h = hashlib.sha256(f"v1|{tokenizer.name}|{tokenizer.vocab_size}|{val_fraction}".encode())
    for path in files:
        stat = path.stat()
        h.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _read_text(path: Path) -> str:
    """A text file as UTF-8; undecodable bytes become U+FFFD, with a warning naming the file."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        text = raw.decode("utf-8", errors="replace")
        log.warning(
            "%s is not valid UTF-8 (first at byte %d of %d: %s); its undecodable bytes are replaced by U+FFFD. "
            "Convert it to UTF-8 to train on its exact text.",
            path,
            e.start,
            len(raw),
            e.reason,
        )
        return text


def _build_cache(files: list[Path], tokenizer: Tokenizer, val_fraction: float, folder: Path) -> None:
    text = "\n".join(_read_text(p) for p in files)
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
