"""The checkpoints of one run: where they live, which one to resume from (the newest that verifies; `latest` is only a
hint), which ones to set aside or delete.

Details: docs/internals.md#checkpointcatalogpy
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from trainmesh.checkpoint.manifest import file_matches, verify
from trainmesh.checkpoint.rank_files import RANK_DIR, UntrustedCheckpointError, read_rank_file
from trainmesh.checkpoint.state import TRAINER_STATE, InvalidTrainerState, TrainerState
from trainmesh.core.errors import UserError
from trainmesh.core.files import fsync_dir, make_dirs, read_bytes, write_atomically
from trainmesh.core.logging import get_logger

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)

CHECKPOINT_DIR = "checkpoints"
LATEST = "latest"
_COMMITTED = re.compile(r"step_(\d{8,})")


class CorruptCheckpointError(UserError, RuntimeError):
    """A checkpoint failed verification and `checkpoint.on_corrupt=abort`."""


class CheckpointCollisionError(UserError, FileExistsError):
    """A run would save a step that the run folder already holds."""


def checkpoint_root(run_dir: Path) -> Path:
    return run_dir / CHECKPOINT_DIR


def make_checkpoint_root(run_dir: Path) -> Path:
    """`<run>/checkpoints`, a real directory inside the run folder (created when missing)."""
    return make_dirs(run_dir, CHECKPOINT_DIR)


def step_dir(run_dir: Path, step: int) -> Path:
    return checkpoint_root(run_dir) / f"step_{step:08d}"


def step_of(path: Path) -> int:
    """The step a committed checkpoint's name says it holds."""
    match = _COMMITTED.fullmatch(path.name)
    assert match, path
    return int(match.group(1))


def staging_dir(final: Path) -> Path:
    return final.with_name(f".{final.name}.tmp")


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoints, oldest first: real directories named step_NNNNNNNN, no symlinks."""
    root = checkpoint_root(run_dir)
    if not root.is_dir() or root.is_symlink():
        return []
    found = [p for p in root.iterdir() if _COMMITTED.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    return sorted(found, key=step_of)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest committed checkpoint (by step; not verified)."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def write_latest(run_dir: Path, final: Path) -> None:
    write_atomically(checkpoint_root(run_dir) / LATEST, final.name + "\n", durable=True)


def _candidates(run_dir: Path) -> list[Path]:
    """Committed checkpoints, newest step first. The `latest` pointer is only compared: it can lag
    behind a commit (a crash or a full disk between the rename and the pointer write)."""
    committed = list(reversed(list_checkpoints(run_dir)))
    pointer = checkpoint_root(run_dir) / LATEST
    try:
        named = read_bytes(pointer, 4096).decode().strip()
    except FileNotFoundError:
        return committed
    except (OSError, ValueError):
        named = "?"
    if committed and named != committed[0].name:
        names = {p.name for p in committed}
        what = "an older checkpoint" if named in names else "no committed checkpoint (garbled or dangling)"
        log.warning(
            "%s names %s, but the newest committed checkpoint is %s: going by the step each one holds",
            pointer,
            what,
            committed[0].name,
        )
    return committed


def find_resumable(run_dir: Path, runtime: Runtime, on_corrupt: str = "fallback") -> Path | None:
    """Collective: the newest checkpoint that verifies, with every rank agreeing on it. Rank 0 alone
    renames and deletes; its failures are raised on every rank (Runtime.on_main)."""
    listed = runtime.broadcast_object(runtime.on_main(lambda: _tidy_and_list(run_dir, on_corrupt))) or []
    for path in [Path(p) for p in listed]:
        problems = check_checkpoint(path, runtime)
        if not problems:
            return path
        report = "\n  ".join(problems)
        if on_corrupt == "abort":
            raise CorruptCheckpointError(
                f"checkpoint {path} failed verification:\n  {report}\n"
                "Fix: remove or repair it, or set --checkpoint.on_corrupt=fallback to resume from an older one."
            )

        def give_up(path: Path = path, report: str = report) -> None:
            log.error("checkpoint %s failed verification, trying an older one:\n  %s", path, report)
            _set_aside(path, "corrupt")

        runtime.on_main(give_up)
    return None


def _tidy_and_list(run_dir: Path, on_corrupt: str) -> list[str]:
    """Rank 0, before a resume: remove what crashed saves left, set foreign folders aside, and list the
    candidates, newest first."""
    _remove_staging_leftovers(run_dir)
    _set_aside_foreign(run_dir, on_corrupt)
    return [str(p) for p in _candidates(run_dir)]


def check_checkpoint(path: Path, runtime: Runtime | None = None) -> list[str]:
    """Why the checkpoint in `path` cannot be used (an empty list: it can). First its files against the
    manifest, then whether what they hold reads as a trainmesh checkpoint: a valid trainer state for the step
    its name says, safe DCP metadata, and RNG files that load safely and hold RNG states. Collective when
    `runtime` is given: the files are hashed, and the RNG files read, spread over the ranks."""
    problems = verify(path, runtime).problems
    if problems:
        return problems
    if runtime is None:
        return _content_problems(path) or _rank_file_problems(_rank_files(path))
    problems = runtime.broadcast_object(_content_problems(path) if runtime.is_main_process else [])
    if problems:  # every rank got rank 0's verdict
        return list(problems)
    mine = _rank_file_problems(_rank_files(path)[runtime.rank :: runtime.world_size])  # rank r: rank_r.pt first
    return [problem for part in runtime.all_gather_object(mine) for problem in part]


def _content_problems(path: Path) -> list[str]:
    """Why a checkpoint whose files match its manifest still cannot be used (an empty list: it can)."""
    from trainmesh.checkpoint.reader import read_metadata  # here: DCP's import, only where a checkpoint is read

    try:
        state = TrainerState.read(path)
        read_metadata(path)
    except (InvalidTrainerState, UntrustedCheckpointError) as e:
        return [str(e)]
    except OSError as e:  # e.g. a name too long in the metadata's shard table
        return [f"{path}: unreadable ({e})"]
    if _COMMITTED.fullmatch(path.name) and state.step != step_of(path):
        return [f"{path}: holds step {state.step}, not the step its name says"]
    return []


def _rank_files(path: Path) -> list[Path]:
    """The RNG files of the checkpoint in `path`, in the order of their ranks (rank_2.pt before rank_10.pt)."""
    return sorted((path / RANK_DIR).glob("rank_*.pt"), key=lambda p: (len(p.name), p.name))


def _rank_file_problems(files: list[Path]) -> list[str]:
    """Why these RNG files cannot be loaded at resume (each is checked as `load_checkpoint` reads it, but mapped:
    verify has just read it whole to hash it, and load_checkpoint will read it again)."""
    problems = []
    for file in files:
        try:
            read_rank_file(file, mapped=True)
        except UntrustedCheckpointError as e:
            problems.append(str(e))
    return problems


def _set_aside_foreign(run_dir: Path, on_corrupt: str) -> None:
    """Move aside every committed folder whose trainer state names another step than its folder (another
    run's checkpoint dropped in): resumed, it would put the run at a step whose save then collides."""
    for path in list_checkpoints(run_dir):
        try:
            if not file_matches(path, TRAINER_STATE):
                continue  # damaged, not foreign: judged by verification if it is ever a candidate
            held = TrainerState.read(path).step
        except InvalidTrainerState:
            continue
        if held == step_of(path):
            continue
        message = f"{path} holds step {held}, not {step_of(path)}: a checkpoint of another run, copied in"
        if on_corrupt == "abort":
            raise CorruptCheckpointError(f"{message}. Fix: move it out of {path.parent}.")
        log.error("%s; moving it aside", message)
        _set_aside(path, "foreign")


def check_no_collision(run_dir: Path, start_step: int, runtime: Runtime) -> None:
    """Collective: refuse, before training, a run whose saves would meet committed checkpoints (a new run
    started without --resume in a folder that already has some)."""
    ahead = runtime.on_main(lambda: [p.name for p in list_checkpoints(run_dir) if step_of(p) > start_step])
    ahead = runtime.broadcast_object(ahead)
    if ahead:
        raise CheckpointCollisionError(
            f"{checkpoint_root(run_dir)} already holds {', '.join(ahead[-3:])}"
            f"{' and more' if len(ahead) > 3 else ''}, and this run starts at step {start_step}: its checkpoints "
            "would collide with them. Fix: --resume to continue that run, or a new --run-id (run.id) for a new one."
        )


def _set_aside(path: Path, why: str) -> None:
    target = path.with_name(f"{path.name}.{why}")
    n = 1
    while target.exists() or target.is_symlink():
        n += 1
        target = path.with_name(f"{path.name}.{why}{n}")
    path.rename(target)
    fsync_dir(path.parent)
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
