"""The checkpoints of one run: where they live, which one to resume from, which ones to delete.

    <run>/checkpoints/step_00000300/     committed (renamed into place after its manifest was written)
    <run>/checkpoints/.step_00000400.tmp/  a save in progress, or one that crashed: never resumed
    <run>/checkpoints/step_00000200.corrupt/  failed verification: kept for inspection, never resumed
    <run>/checkpoints/latest             the name of the newest committed checkpoint (a hint)

Resuming picks the newest checkpoint that verifies against its manifest; a bad one is reported with
the offending file and hash and moved aside, and the previous one is tried (or the run aborts, with
`checkpoint.on_corrupt=abort`). Only names this module creates are ever listed, renamed or deleted,
symlinks are never followed, and nothing outside `<run>/checkpoints` is touched.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainmesh.checkpoint.manifest import fsync_dir, verify
from trainmesh.runtime.logging import get_logger

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_COMMITTED = re.compile(r"step_\d{8}")


class CorruptCheckpointError(RuntimeError):
    """A checkpoint failed verification and `checkpoint.on_corrupt=abort`."""


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def staging_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first: real directories named step_NNNNNNNN, no symlinks."""
    root = checkpoint_root(run_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    found = [p for p in root.iterdir() if _COMMITTED.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed checkpoint (by name; not verified)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def write_latest(run_dir: Path, final: Path) -> None:
    pointer = checkpoint_root(run_dir) / LATEST
    tmp = pointer.with_name(f".{LATEST}.tmp")
    tmp.write_text(final.name + "\n")
    tmp.replace(pointer)
    fsync_dir(pointer.parent)


def _candidates(run_dir: Path) -> list[Path]:
    """Newest first; the `latest` pointer's target leads when it names a committed checkpoint."""
    committed = list(reversed(list_checkpoints(run_dir)))
    pointer = checkpoint_root(run_dir) / LATEST
    try:
        named = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        named = ""
    by_name = {p.name: p for p in committed}
    if named in by_name:
        return [by_name[named], *(p for p in committed if p.name != named)]
    if committed and pointer.exists():
        log.warning("%s is garbled or dangling (%r); scanning for the newest checkpoint instead", pointer, named[:80])
    return committed


def find_resumable(run_dir: Path, runtime: Runtime, on_corrupt: str = "fallback") -> Path | None:
    """Collective: the newest checkpoint that verifies, with every rank agreeing on it."""
    if runtime.is_main_process:
        _remove_staging_leftovers(run_dir)
    candidates = [Path(p) for p in runtime.broadcast_object([str(p) for p in _candidates(run_dir)])]
    for path in candidates:
        verdict = verify(path, runtime)
        if verdict.ok:
            return path
        report = "\n  ".join(verdict.problems)
        if on_corrupt == "abort":
            raise CorruptCheckpointError(
                f"checkpoint {path} failed verification:\n  {report}\n"
                "Fix: remove or repair it, or set --checkpoint.on_corrupt=fallback to resume from an older one."
            )
        if runtime.is_main_process:
            log.error("checkpoint %s failed verification, trying an older one:\n  %s", path, report)
            _quarantine(path)
        runtime.barrier()
    return None


def _quarantine(path: Path) -> None:
    target = path.with_name(f"{path.name}.corrupt")
    n = 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.corrupt{n}")
    path.rename(target)
    log.error("moved it aside to %s (nothing was loaded from it)", target)


def _remove_staging_leftovers(run_dir: Path) -> None:
    root = checkpoint_root(run_dir)
    if not root.is_dir() or root.is_symlink():
        return
    for leftover in root.glob(".step_*.tmp"):
        if _COMMITTED.fullmatch(leftover.name[1:-4]) and leftover.is_dir() and not leftover.is_symlink():
            log.warning("removing %s, left by a save that never committed", leftover)
            shutil.rmtree(leftover)


def rotate(run_dir: Path, keep_last: int) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep_last` (0 keeps all); rank 0 only.

    Called right after a commit, so the newest — the one just verified by construction — always stays.
    """
    if keep_last <= 0:
        return []
    doomed = list_checkpoints(run_dir)[:-keep_last]
    for old in doomed:
        shutil.rmtree(old)  # removes symlinks inside it without following them
    return doomed
