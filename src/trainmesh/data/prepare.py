"""`trainmesh data prepare`: documents in, llm.c-style token shards and a manifest out, streamed end to end and
committed from a staging folder by rename.

Details: docs/internals.md#datapreparepy
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from trainmesh.core.errors import UserError
from trainmesh.core.files import (
    FolderOwner,
    check_replaceable,
    remove_tree,
    replace_folder,
    warn_moved_aside,
    write_atomically,
)
from trainmesh.core.logging import get_logger
from trainmesh.core.machine import available_cpus
from trainmesh.core.signals import signals_held
from trainmesh.core.versions import package_version
from trainmesh.data.encode import encode_pieces
from trainmesh.data.manifest import (
    MANIFEST,
    Manifest,
    SourceInfo,
    SplitInfo,
    TokenizerInfo,
    prepared_files,
)
from trainmesh.data.shards import MAX_SHARD_TOKENS, ShardWriter
from trainmesh.data.sources import Source, SourceError, check_readers, find_sources, read_pieces
from trainmesh.data.split import TrainValSplit
from trainmesh.data.tokenizer import Tokenizer, get_tokenizer, tokenizer_names

log = get_logger(__name__)

DEFAULT_SHARD_TOKENS = 10**8  # llm.c's fineweb.py: 200 MB a shard
UINT16_IDS = int(np.iinfo(np.uint16).max) + 1


class PrepareError(UserError, ValueError):
    """Options or an output folder that `trainmesh data prepare` refuses."""


class OutputFullError(OSError):
    """A disk-full error from writing the shards or the manifest, told apart from one elsewhere (the worker
    processes' semaphores in /dev/shm, say), which --out's disk is not to blame for."""


PREPARED = FolderOwner(
    command="trainmesh data prepare",
    marker=MANIFEST,
    written=prepared_files,  # its manifest.json and the shards that lists
    error=PrepareError,
    label="--out={path!r}",
    other="another --out",
)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass(frozen=True)
class PrepareOptions:
    """`trainmesh data prepare`'s options (the cli's flags of the same names)."""

    inputs: tuple[Path, ...]
    out: Path
    tokenizer: str = "byte"
    text_field: str = "text"
    val_fraction: float = 0.05
    shard_tokens: int = DEFAULT_SHARD_TOKENS
    workers: int = 0
    """0: one per available CPU"""
    force: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.val_fraction <= 0.5:
            raise PrepareError(
                f"--val-fraction={self.val_fraction}: the share of tokens held out for validation must be more "
                "than 0 and at most 0.5. Fix: e.g. --val-fraction=0.01 for a large corpus (llm.c holds out 1e8 "
                "tokens of FineWeb's 1e10)."
            )
        if not 0 < self.shard_tokens <= MAX_SHARD_TOKENS:
            raise PrepareError(
                f"--shard-tokens={self.shard_tokens}: a shard holds 1 to {MAX_SHARD_TOKENS:,} tokens (its header "
                f"counts them in an int32). Fix: --shard-tokens={DEFAULT_SHARD_TOKENS} (llm.c's size)."
            )
        if self.workers < 0:
            raise PrepareError(f"--workers={self.workers}: a count of processes. Fix: --workers=0 (one per CPU).")
        if not self.text_field:
            raise PrepareError("--text-field is empty. Fix: --text-field=text (the field or column with the text).")


@dataclass(frozen=True)
class Prepared:
    folder: Path
    manifest: Manifest


def prepare(options: PrepareOptions) -> Prepared:
    """Check everything, then tokenise the inputs into `options.out` (replacing it only with `force`)."""
    tokenizer = _tokenizer(options.tokenizer)
    sources = find_sources(options.inputs)
    check_readers(sources)
    out = options.out
    existed = _check_out(out, list(options.inputs), sources, options.force)
    _make_folder(out.parent, out, parents=True, exist_ok=True)
    for left in sorted(out.parent.glob(f".{out.name}.partial-*")):  # not removed: its process may still run
        log.warning("%s was left by a prepare that was killed (or still runs); remove it once it is not", left)
    warn_moved_aside(out)
    staging = out.parent / f".{out.name}.partial-{os.getpid()}"
    workers = options.workers or available_cpus()
    try:
        remove_tree(staging)  # a leftover of a killed prepare that had this pid
        _make_folder(staging, out)
        record = {
            "inputs": [str(p) for p in options.inputs],
            "tokenizer": options.tokenizer,
            "text_field": options.text_field,
            "val_fraction": options.val_fraction,
            "shard_tokens": options.shard_tokens,
        }  # not the workers: the data is the same for any number, and so is the manifest
        manifest = build(
            sources,
            staging,
            out.name,  # as typed: _check_out refused a symlink, '.' and '..'
            tokenizer,
            text_field=options.text_field,
            val_fraction=options.val_fraction,
            shard_tokens=options.shard_tokens,
            workers=workers,
            progress=options.progress,
            record=record,
        )
        with signals_held() as stops:  # a stop waits until the old --out is replaced, or put back
            _commit(staging, out, options.force, existed)
            if stops:  # the data is complete and in place: stopping now would undo nothing
                log.warning("%s arrived as %s was committed; it is complete", signal.Signals(stops[0]).name, out)
                stops.clear()
    except BaseException as e:  # Ctrl-C and SIGTERM (the cli's) included: no half-written folder stays behind
        with signals_held():  # a second stop waits until the staging folder is gone
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            raise _disk_full(out, e) from None
        raise
    return Prepared(out, manifest)


def _make_folder(folder: Path, out: Path, **options: bool) -> None:
    try:
        folder.mkdir(**options)
    except OSError as e:  # no permission, a read-only file system, a file where a folder must be, a full disk
        fix = (
            "free space on that disk, or an --out on another"
            if e.errno in DISK_FULL
            else "an --out in a folder you may write to"
        )
        raise PrepareError(
            f"--out={str(out)!r}: cannot create the folder {str(folder)!r} ({e.strerror}). Fix: {fix}."
        ) from None


def _disk_full(out: Path, error: OSError) -> PrepareError:
    """The one-line error for a disk that filled up (or a quota reached): --out's while the shards or the manifest
    were written (OutputFullError), else the one at the error's path (the workers' semaphores' errors name none)."""
    if not isinstance(error, OutputFullError):
        where, fix = repr(error.filename), "free space there"
        if not error.filename:
            where = "a path the error does not name (most likely /dev/shm, where the workers share memory)"
            fix = "free space in /dev/shm, or --workers=1 (tokenise in this process)"
        return PrepareError(
            f"a disk is full ({error.strerror}) at {where}, not while prepare wrote to --out; the partial output "
            f"was removed and nothing was written to --out. Fix: {fix}."
        )
    try:
        free = f"{shutil.disk_usage(out.parent).free:,} bytes free there now"
    except OSError:
        free = "its free space unknown"
    return PrepareError(
        f"--out={str(out)!r}: the disk holding {str(out.parent)!r} is full ({error.strerror}; {free}) while prepare "
        "wrote its shards; the partial output was removed and nothing was written to --out. Fix: free space there "
        "(the shards take 2 bytes a token: about half the text's size with GPT-2's tokenizer, twice it with the "
        "byte one; an earlier output replaced with --force stays until the new one is complete), or an --out on "
        "another disk."
    )


@contextmanager
def _writing() -> Iterator[None]:
    """Marks a disk-full error raised inside, where the shards or the manifest are written, as OutputFullError."""
    try:
        yield
    except OSError as e:
        if e.errno not in DISK_FULL:
            raise
        raise OutputFullError(e.errno, e.strerror, e.filename) from e


def build(
    sources: Sequence[Source],
    folder: Path,
    name: str,
    tokenizer: Tokenizer,
    *,
    text_field: str = "text",
    val_fraction: float,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    workers: int = 1,
    progress: bool = True,
    record: dict[str, Any] | None = None,
) -> Manifest:
    """Tokenise `sources` into shards `name`_train_*.bin / `name`_val_*.bin and manifest.json in `folder`
    (empty, and renamed into place by the caller once this returns)."""
    if tokenizer.vocab_size > UINT16_IDS:
        raise PrepareError(
            f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size:,} token ids; the shards store uint16 ids "
            f"(llm.c's version-1 layout), which hold {UINT16_IDS:,}. Fix: a tokenizer of at most {UINT16_IDS:,}."
        )
    started = time.perf_counter()
    described = _describe_sources(sources, progress)
    writers = {split: ShardWriter(folder, name, split, shard_tokens) for split in ("train", "val")}
    split = TrainValSplit(val_fraction, writers["train"], writers["val"])
    pieces = chain.from_iterable(read_pieces(source, text_field) for source in sources)
    total = sum(s.bytes for s in described)
    with _bar(progress, total, "tokenising") as bar:
        for encoded in encode_pieces(pieces, tokenizer, workers):
            with _writing():
                split.feed(encoded.tokens, encoded.document_starts)
            bar.update(encoded.source_bytes)
            bar.set_postfix_str(f"{split.tokens:,} tokens", refresh=False)
    with _writing():
        split.finish()
        splits = {part: SplitInfo(split.documents[part], w.tokens, tuple(w.close())) for part, w in writers.items()}
    manifest = Manifest(
        tokenizer=TokenizerInfo(tokenizer.name, tokenizer.vocab_size, tokenizer.eot),
        train=splits["train"],
        val=splits["val"],
        sources=tuple(described),
        options=record or {},
        trainmesh_version=package_version("trainmesh"),
    )
    # Last, and durably (the shards were fsynced as they were closed): a folder with a manifest is complete,
    # after a power loss too, once the caller's rename is.
    with _writing():
        write_atomically(folder / MANIFEST, manifest.to_json(), durable=True)
    _log_summary(manifest, total, time.perf_counter() - started, workers)
    return manifest


def _tokenizer(name: str) -> Tokenizer:
    if name not in tokenizer_names():
        raise PrepareError(
            f"--tokenizer={name!r} is unknown; registered: {', '.join(tokenizer_names())}. "
            "Fix: --tokenizer=gpt2 (GPT-2's BPE) or --tokenizer=byte."
        )
    return get_tokenizer(name)  # built here once, so that missing vocabulary files stop the run before any work


def _check_out(out: Path, inputs: list[Path], sources: Sequence[Source], force: bool) -> bool:
    """Refuse an --out that would read or replace its own inputs, or replace data without --force; returns
    whether `out` exists (an empty folder, or with --force one it may replace)."""
    if out.name in ("", ".", ".."):
        raise PrepareError(
            f"--out={str(out)!r} does not end in a folder's name; prepare writes that folder beside its staging "
            "folder and names the shards after it. Fix: name the folder, e.g. --out=data/mycorpus."
        )
    _refuse_symlink(out)
    real_out = out.resolve()
    for given in [*inputs, *(s.path for s in sources)]:
        real = given.resolve()
        if given.is_dir() and real_out.is_relative_to(real):
            raise PrepareError(
                f"--out={str(out)!r} is inside the input folder {str(given)!r}: prepare would read its own output "
                "there (this time or the next). Fix: an --out outside the input folders."
            )
        if real.is_relative_to(real_out):
            raise PrepareError(
                f"the input {str(given)!r} is inside --out={str(out)!r}, which prepare replaces. "
                "Fix: an --out that holds none of the inputs."
            )
    check_replaceable(out, PREPARED)  # an empty folder or an earlier prepare's output, with --force or without
    if out.is_dir() and any(out.iterdir()) and not force:
        raise PrepareError(
            f"--out={str(out)!r} exists and is not empty (an earlier prepare's output). Fix: --force to replace "
            "it (it is removed once the new data is complete), or another --out."
        )
    return out.exists()


def _refuse_symlink(out: Path) -> None:
    if out.is_symlink():
        raise PrepareError(
            f"--out={str(out)!r} is a symlink (to {os.readlink(out)!r}): prepare commits its output by renaming a "
            "complete folder to --out, which would replace the link rather than fill the folder it points to. "
            f"Fix: --out={str(out.resolve())!r} (the folder itself), or another --out."
        )


def _commit(staging: Path, out: Path, force: bool, existed: bool) -> None:
    """Rename the complete staging folder to `out` (core/files.py `replace_folder`). `out` is looked at again:
    the run may have taken hours, and only what is there now may be replaced (with --force, `replace_folder`
    checks it once moved aside, so a file written there at any moment is never deleted)."""
    _refuse_symlink(out)
    if not force and existed:  # an empty folder at the start, accepted without --force: taken only if still empty
        try:
            out.rmdir()
        except FileNotFoundError:
            pass
        except OSError:
            raise PrepareError(
                f"--out={str(out)!r} was an empty folder when prepare started, and is not now (something wrote to it "
                "meanwhile); it is not replaced without --force, and the new data is not kept. Fix: another --out, "
                "or --force to replace it."
            ) from None
    try:
        replace_folder(staging, out, replace=force, owner=PREPARED)
    except FileExistsError:
        raise PrepareError(
            f"--out={str(out)!r} appeared while prepare ran (another prepare to the same --out?); it is not replaced "
            "without --force, and the new data is not kept. Fix: another --out, or --force to replace it."
        ) from None


def _describe_sources(sources: Sequence[Source], progress: bool) -> list[SourceInfo]:
    """Each source's size and SHA-256 (a pass over the inputs before the tokenising one)."""
    files = {source: source.files() for source in sources}
    sizes = {p: _size(p) for paths in files.values() for p in paths}
    described = []
    with _bar(progress, sum(sizes.values()), "hashing") as bar:
        for source, paths in files.items():
            digests = []
            for path in paths:
                try:
                    with path.open("rb") as f:
                        digests.append(hashlib.file_digest(f, "sha256").hexdigest())
                except OSError as e:  # removed or made unreadable since it was found
                    raise SourceError(f"cannot read input {path}: {e.strerror or e}") from None
                bar.update(sizes[path])
            if source.kind == "hf":
                lines = sorted(f"{d}  {p.relative_to(source.path)}\n" for d, p in zip(digests, paths, strict=True))
                digest = hashlib.sha256("".join(lines).encode()).hexdigest()
            else:
                digest = digests[0]
            size = sum(sizes[p] for p in paths)
            described.append(SourceInfo(str(source.path.resolve()), source.kind, size, digest))
    return described


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError as e:
        raise SourceError(f"cannot read input {path}: {e.strerror or e}") from None


def _bar(progress: bool, total: int, what: str) -> tqdm[Any]:
    """A progress bar on stderr, drawn only on a terminal (disable=None) and unless switched off."""
    return tqdm(
        total=total,
        desc=what,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        file=sys.stderr,
        disable=None if progress else True,
        dynamic_ncols=True,
    )


def _log_summary(manifest: Manifest, source_bytes: int, seconds: float, workers: int) -> None:
    train, val = manifest.train, manifest.val
    tokens = train.tokens + val.tokens
    log.info(
        "tokenised %d input(s), %s bytes, with %s in %.1f s (%.1f MB/s, %s tokens/s, %d worker(s)): %s document(s), "
        "%s tokens; train %s in %d shard(s), val %s in %d",
        len(manifest.sources),
        f"{source_bytes:,}",
        manifest.tokenizer.name,
        seconds,
        source_bytes / max(seconds, 1e-9) / 1e6,
        f"{tokens / max(seconds, 1e-9):,.0f}",
        workers,
        f"{train.documents + val.documents:,}",
        f"{tokens:,}",
        f"{train.tokens:,}",
        len(train.shards),
        f"{val.tokens:,}",
        len(val.shards),
    )
