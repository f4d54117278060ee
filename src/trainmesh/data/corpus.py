"""Corpora as memory-mapped token files: the embedded corpus, a text file (tokenised once, cached) or a folder of token
shards used in place, checked before training.

Details: docs/internals.md#datacorpuspy
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from trainmesh.core.env import cache_home
from trainmesh.core.files import replace_folder
from trainmesh.core.logging import get_logger
from trainmesh.core.machine import available_cpus
from trainmesh.data.manifest import MANIFEST, Manifest, read_manifest, shard_path
from trainmesh.data.prepare import build
from trainmesh.data.shards import HEADER_BYTES, BadShardError, llmc_token_count, load_tokens
from trainmesh.data.sources import text_source
from trainmesh.data.tokenizer import Tokenizer

log = get_logger(__name__)

PARALLEL_BYTES = 64 << 20  # less text is tokenised faster in this process than by starting workers
SCAN_TOKENS = 1 << 22  # 8 MiB a chunk: hashed, then scanned while it is still in the CPU's caches
SCAN_THREADS = 8  # shards read at once: enough to keep a disk busy, not a storm on a network file system
RACY_NS = 2_000_000_000
"""A file changed this recently may change again within the same ctime tick after it was read: not cached (as
git treats a "racily clean" index entry)."""
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
__all__ = ["BadShardError", "TokenCorpus", "check_token_range", "embedded_files", "load_tokens", "shard_corpus"]


@dataclass(frozen=True)
class TokenCorpus:
    """Where the train and val token shards of a corpus live."""

    train: tuple[Path, ...]
    val: tuple[Path, ...]
    vocab_size: int
    """From the tokenizer (or a prepared folder's manifest); 0 for shards from elsewhere (model.vocab_size must
    then be set)."""
    sha256: dict[Path, str] = field(default_factory=dict)
    """Each shard's SHA-256 as a prepared folder's manifest records it; empty for shards from elsewhere."""


def default_cache_dir() -> Path:
    base = str(cache_home())
    return Path(base) / "trainmesh"


def embedded_files(max_bytes: int) -> list[Path]:
    """The standard library's .py files in a fixed order (by path), up to `max_bytes` in total."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in _python_files(root):
        size = path.stat().st_size
        if total + size > max_bytes:
            continue
        files.append(path)
        total += size
    if not files:
        raise RuntimeError(f"no Python source found under {root} for the embedded corpus")
    return files


def _python_files(folder: Path) -> Iterator[Path]:
    """`sorted(folder.rglob("*.py"))` without walking _SKIP_DIRS (site-packages: a second a worker, before)."""
    with os.scandir(folder) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            if entry.name not in _SKIP_DIRS:
                yield from _python_files(Path(entry.path))
        elif entry.name.endswith(".py") and entry.is_file():
            yield Path(entry.path)


def shard_corpus(folder: Path) -> TokenCorpus:
    """A folder of pre-tokenised shards: those its manifest.json lists, else the files whose names contain
    'train' / 'val'."""
    manifest = read_manifest(folder)
    if manifest is not None:
        return _prepared_corpus(folder, manifest)
    shards = sorted(p for p in folder.iterdir() if p.suffix in (".bin", ".npy"))
    train = tuple(p for p in shards if "train" in p.name)
    val = tuple(p for p in shards if "val" in p.name)
    if not train or not val:
        raise BadShardError(
            f"data.source={str(folder)!r}: a shard folder needs *train*.bin|.npy and *val*.bin|.npy files; "
            f"found {[p.name for p in shards] or 'none'}. Fix: --data.source=<a folder with both, or a text file>."
        )
    for path in (*train, *val):
        load_tokens(path)  # its header and size (a memory map: only the header is read)
    return TokenCorpus(train, val, vocab_size=0)  # unknown: shards carry no tokenizer, the config says


def text_corpus(files: list[Path], tokenizer: Tokenizer, val_fraction: float, cache_dir: Path) -> TokenCorpus:
    """Tokenise text files (each one document) once into cache_dir/<hash>/ and return the cached shards."""
    folder = cache_dir / _cache_key(files, tokenizer, val_fraction)
    manifest = read_manifest(folder)
    if manifest is None:
        manifest = _build_cache(files, tokenizer, val_fraction, folder)
    return _prepared_corpus(folder, manifest)


def _prepared_corpus(folder: Path, manifest: Manifest) -> TokenCorpus:
    """The shards a manifest lists, each checked to be a file of the folder, there in full (a header and size
    that agree with the manifest), and listed once."""
    seen: set[Path] = set()
    for info in (*manifest.train.shards, *manifest.val.shards):
        path = shard_path(folder, info.file)
        if not path.is_file():
            raise BadShardError(
                f"token shard {path}, which {folder / MANIFEST} lists, is missing: the folder was copied "
                "in part. Fix: copy it whole, or prepare it again (trainmesh data prepare)."
            )
        real = path.resolve()
        if real in seen:  # it would train twice, or be validated on while trained on
            raise BadShardError(
                f"{folder / MANIFEST} lists token shard {path} twice (by name or through a symlink). "
                "Fix: prepare the folder again (trainmesh data prepare)."
            )
        seen.add(real)
        count = llmc_token_count(path)
        if count != info.tokens:
            raise BadShardError(
                f"token shard {path} holds {'no llm.c header' if count is None else f'{count:,} tokens'}, but "
                f"{folder / MANIFEST} says {info.tokens:,} tokens: corrupted, or replaced. "
                "Fix: prepare the folder again (trainmesh data prepare)."
            )
    train = tuple(folder / s.file for s in manifest.train.shards)
    val = tuple(folder / s.file for s in manifest.val.shards)
    digests = {folder / s.file: s.sha256 for s in (*manifest.train.shards, *manifest.val.shards)}
    return TokenCorpus(train, val, manifest.tokenizer.vocab_size, digests)


def check_token_range(corpus: TokenCorpus, vocab_size: int, cache_dir: Path) -> None:
    """Refuse a corpus with a token id outside 0..`vocab_size`-1, or a prepared shard that is no longer the file
    its manifest recorded, naming the shard and the fix. A shard not seen before is read whole, several at once
    (hashing and numpy's min/max release the GIL); what it holds is then cached in `cache_dir`."""
    shards = (*corpus.train, *corpus.val)
    pool = ThreadPoolExecutor(max_workers=max(1, min(len(shards), available_cpus(), SCAN_THREADS)))
    try:
        ranges = list(pool.map(lambda path: _token_range(path, corpus.sha256.get(path), cache_dir), shards))
    finally:
        pool.shutdown(cancel_futures=True)  # after a refusal, the shards not yet read are not read
    for path, (lowest, highest) in zip(shards, ranges, strict=True):
        if lowest < 0:
            raise BadShardError(f"token shard {path} holds a negative token id ({lowest}): not token ids")
        if highest >= vocab_size:
            raise BadShardError(
                f"token shard {path} holds token id {highest}, outside the model's vocabulary of {vocab_size} "
                f"(model.vocab_size). Fix: --model.vocab_size={highest + 1} or more (a multiple of 64 is fastest, "
                "e.g. 50304 for GPT-2's tokenizer), or re-tokenise the data with data.tokenizer."
            )


def _token_range(path: Path, sha256: str | None, cache_dir: Path) -> tuple[int, int]:
    """`_scan`'s result, from the cache when this very file was scanned before."""
    before = path.stat()
    identity = f"v2|{path.resolve()}|{sha256}|{before.st_dev}|{before.st_ino}|{before.st_size}"
    changed = f"{before.st_mtime_ns}|{before.st_ctime_ns}"
    cached = cache_dir / "shard-stats" / f"{hashlib.sha256(f'{identity}|{changed}'.encode()).hexdigest()[:32]}.json"
    try:
        record = json.loads(cached.read_text())
        return int(record["min_token"]), int(record["max_token"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    lowest, highest = _scan(path, sha256)
    after = path.stat()
    if (after.st_mtime_ns, after.st_ctime_ns) == (before.st_mtime_ns, before.st_ctime_ns) and (
        time.time_ns() - after.st_ctime_ns > RACY_NS
    ):
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_name(f".{cached.name}.{os.getpid()}")
            tmp.write_text(json.dumps({"path": str(path), "min_token": lowest, "max_token": highest}))
            tmp.replace(cached)
        except OSError as e:  # a read-only cache costs a scan next time, nothing more
            log.debug("could not cache the token range of %s: %s", path, e)
    return lowest, highest


def _scan(path: Path, sha256: str | None) -> tuple[int, int]:
    """The smallest and largest token id in a shard. With `sha256` (the manifest's), the file is hashed in the
    same pass and refused when it differs: a shard rewritten in place keeps its size and may keep its mtime."""
    tokens = load_tokens(path)
    digest = None
    if sha256 is not None:
        with path.open("rb") as f:  # a listed shard is llm.c's (its count matched): the header, then the tokens
            digest = hashlib.sha256(f.read(HEADER_BYTES))
    bounds = []  # load_tokens refuses an empty shard: one chunk at least
    for start in range(0, len(tokens), SCAN_TOKENS):
        chunk = tokens[start : start + SCAN_TOKENS]
        if digest is not None:
            digest.update(chunk.data)  # the bytes as on disk: the memory map is of the file
        bounds.append((int(chunk.min()), int(chunk.max())))
    if digest is not None and digest.hexdigest() != sha256:
        raise BadShardError(
            f"token shard {path} has SHA-256 {digest.hexdigest()}, but {path.parent / MANIFEST} says {sha256}: "
            "corrupted, or replaced since trainmesh data prepare wrote it. Fix: copy the folder whole again, "
            "or prepare it again (trainmesh data prepare)."
        )
    return min(low for low, _ in bounds), max(high for _, high in bounds)


def _cache_key(files: list[Path], tokenizer: Tokenizer, val_fraction: float) -> str:
    # v2: llm.c-headered shards, one document per file after the tokenizer's eot (v1: raw uint16, files joined)
    h = hashlib.sha256(f"v2|{tokenizer.name}|{tokenizer.vocab_size}|{val_fraction}".encode())
    for path in files:
        stat = path.stat()
        h.update(f"|{path}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def _build_cache(files: list[Path], tokenizer: Tokenizer, val_fraction: float, folder: Path) -> Manifest:
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    large = sum(p.stat().st_size for p in files) >= PARALLEL_BYTES
    try:
        manifest = build(
            [text_source(p) for p in files],
            staging,
            "corpus",
            tokenizer,
            val_fraction=val_fraction,
            workers=available_cpus() if large else 1,
            record={"inputs": [str(p) for p in files], "tokenizer": tokenizer.name, "val_fraction": val_fraction},
        )
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        replace_folder(staging, folder, replace=False)  # durable, atomic; loses the race if another builder won
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        manifest = read_manifest(folder) or manifest
    log.info("tokenised %d file(s) -> %s", len(files), folder)
    return manifest
