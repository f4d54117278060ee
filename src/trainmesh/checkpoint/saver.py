"""Writing checkpoints: every rank in parallel, committed atomically by rename, optionally in the background
(`checkpoint.async_save`); every rank learns the outcome of each step. DCP is imported where a save starts: with the
DTensor it imports, a second of start-up that a run which never saves does not pay.

Details: docs/internals.md#checkpointsaverpy
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.torch_version import TorchVersion

from trainmesh.checkpoint.catalog import (
    CheckpointCollisionError,
    list_checkpoints,
    make_checkpoint_root,
    rotate,
    staging_dir,
    step_dir,
    write_latest,
)
from trainmesh.checkpoint.dcp import find_cause, rng_state, single_process_quiet
from trainmesh.checkpoint.manifest import PeerFailed, write_json_durably, write_manifest
from trainmesh.checkpoint.rank_files import RANK_DIR
from trainmesh.checkpoint.state import TRAINER_STATE, TrainerState
from trainmesh.core.dtensors import is_dtensor
from trainmesh.core.errors import UserError
from trainmesh.core.files import fsync_dir
from trainmesh.core.logging import get_logger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.checkpoint.staging import DefaultStager

    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_NO_SPACE_MESSAGE = "No space left on device"


# Before torch 2.13, DefaultStager empties its copier table after every stage, so a second save through the same
# stager fails with KeyError: <class 'type'> on any non-tensor value in the state (found on an H100 with torch
# 2.11; tests/unit/test_async_checkpoint.py). There, each save gets its own stager, closed once it is committed.
FRESH_STAGER_PER_SAVE = TorchVersion(torch.__version__) < "2.13"


def _nothing(step: int, phase: str) -> None:
    pass


class CheckpointWriteError(UserError, RuntimeError):
    """A checkpoint could not be written; raised on every rank alike. Older checkpoints are intact."""


@dataclass
class _Save:
    """One save, captured at the step boundary."""

    step: int
    staging: Path
    final: Path
    trainer_state: dict[str, Any]
    rng: dict[str, Any]
    sizes: dict[str, tuple[int, bool]]  # of this rank's tensors (`_tensor_sizes`)
    state_dict: dict[str, Any] | None  # written synchronously, or
    written: Future[Any] | None  # being written by DCP's async_save


class Checkpointer:
    """Saves checkpoints of one run. Collective: every rank creates it and calls `save` together."""

    def __init__(
        self,
        run_dir: Path,
        runtime: Runtime,
        keep_last: int = 0,
        background: bool = False,
        at_phase: Callable[[int, str], None] | None = None,
    ) -> None:
        """`at_phase(step, phase)`: called on each rank once its shards are written ("checkpoint") and on rank 0
        after the commit rename ("commit"); the fault-injection test hook (train/faults.py) passes its own."""
        self.run_dir, self.runtime, self.keep_last = run_dir, runtime, keep_last
        self.at_phase = at_phase or _nothing
        self.background = background
        self._group: ProcessGroup | None = runtime.new_group() if background else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainmesh-checkpoint") if background else None
        self._pinned = torch.cuda.is_available()  # stage GPU tensors into pinned CPU memory (fast copies)
        self._stager: DefaultStager | None = None
        self._pending: Future[None] | None = None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState) -> Path:
        """Save (or start saving) `state.step`; returns the folder the checkpoint is committed to."""
        self.wait()  # one save in flight at most
        rt = self.runtime
        final = step_dir(self.run_dir, state.step)
        if rt.broadcast_object((final.exists() or final.is_symlink()) if rt.is_main_process else False):
            raise CheckpointCollisionError(
                f"checkpoint {final} already exists; a committed checkpoint is never overwritten"
            )
        model_state, optim_state = rt.state_dicts(model, optimizer)
        tensors = {"model": model_state, "optim": optim_state}
        staging = staging_dir(final)
        rank = {**rng_state(), "strategy": rt.strategy.rank_state()}  # taken now: the next step changes both
        job = _Save(state.step, staging, final, asdict(state), rank, _tensor_sizes(tensors), None, None)
        self._agreed(lambda: self._make_staging(staging) if rt.is_main_process else None, job)
        if self._executor is None:
            job.state_dict = tensors
            self._complete(job)
            return final
        from torch.distributed.checkpoint import async_save  # DCP's import, where a run saves (module docstring)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        with single_process_quiet():  # copies to CPU memory now; writes in DCP's thread
            if self._stager is None:  # kept across saves: it reuses its (pinned) CPU copies of the same tensors
                self._stager = DefaultStager(StagingOptions(self._pinned, False, False, False))
            written = async_save(
                tensors, checkpoint_id=str(staging), process_group=self._group, async_stager=self._stager
            )
            job.written = cast(Future, written)
        self._pending = self._executor.submit(self._complete, job)
        return final

    def _make_staging(self, staging: Path) -> None:
        """Rank 0: an empty staging folder, in a real `checkpoints` directory of the run."""
        make_checkpoint_root(self.run_dir)  # refuses a symlinked checkpoints folder
        if staging.is_symlink():
            staging.unlink()
        elif staging.exists():
            shutil.rmtree(staging)  # leftover of a crashed save of this step
        (staging / RANK_DIR).mkdir(parents=True)

    def wait(self) -> None:
        """Until the save in flight is committed (re-raising its error, on every rank alike)."""
        pending, self._pending = self._pending, None
        try:
            if pending is not None:
                pending.result()
        finally:
            if FRESH_STAGER_PER_SAVE:
                self._close_stager()

    def close(self) -> None:
        self.wait()
        self._close_stager()
        if self._executor is not None:
            self._executor.shutdown()

    def _close_stager(self) -> None:
        stager, self._stager = self._stager, None
        if stager is not None:
            stager.close()

    def _complete(self, job: _Save) -> None:
        """Steps 2-4 of docs/internals.md#checkpointsaverpy (in the background thread for async saves)."""
        rt = self.runtime

        def write_mine() -> None:
            if job.state_dict is not None:
                from torch.distributed.checkpoint import save

                with single_process_quiet():
                    save(job.state_dict, checkpoint_id=str(job.staging))
            if job.written is not None:
                job.written.result()
            torch.save(job.rng, job.staging / RANK_DIR / f"rank_{rt.rank}.pt")
            self.at_phase(job.step, "checkpoint")  # test hook: fail before the commit
            if rt.is_main_process:
                write_json_durably(job.staging / TRAINER_STATE, job.trainer_state)

        def commit() -> None:
            if rt.is_main_process:
                job.staging.rename(job.final)
                fsync_dir(job.final.parent)
                log.info("saved checkpoint %s", job.final)

        self._agreed(write_mine, job)
        self._agreed(lambda: write_manifest(job.staging, rt, self._group), job)  # hashes and fsyncs, in parallel
        self._agreed(commit, job)
        if rt.is_main_process:
            self._after_commit(job)

    def _after_commit(self, job: _Save) -> None:
        """Rank 0: point `latest` at the new checkpoint and rotate. The checkpoint is committed already,
        so a failure here costs a warning, not the run."""
        try:
            self.at_phase(job.step, "commit")  # test hook: e.g. the disk fills
            write_latest(self.run_dir, job.final)
            for old in rotate(self.run_dir, self.keep_last):
                log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", old, self.keep_last)
        except Exception as e:  # the disk filled up, say
            log.warning(
                "checkpoint %s is committed, but updating checkpoints/latest or removing old checkpoints failed: %s. "
                "Nothing is lost: resuming goes by the step each checkpoint holds.",
                job.final,
                e,
            )

    def _agreed(self, action: Callable[[], None], job: _Save) -> None:
        """Run this rank's part of a step; if any rank's part failed, fail on every rank with the same
        error (a rank that raised alone would leave the others waiting in the next collective until the
        timeout)."""
        from torch.distributed.checkpoint.api import CheckpointException

        rt, error, origin = self.runtime, None, [self.runtime.rank]
        try:
            action()
        except PeerFailed:  # the rank that failed says why
            pass
        except (Exception, CheckpointException) as e:  # torch.save on a full disk raises a RuntimeError
            error = _describe_error(e, job.staging, sum(size for size, _ in job.sizes.values()))
            if isinstance(e, CheckpointException):  # DCP raises on every rank: the ranks it names failed
                origin = sorted(e.failures)
        free = _free_bytes(job.staging.parent) if error else 0  # before the staging folder goes
        outcomes = rt.all_gather_object((error, free, origin), group=self._group)
        reported = [(e, free) for e, free, _ in outcomes if e]
        if not reported:
            return
        if rt.is_main_process:
            shutil.rmtree(job.staging, ignore_errors=True)
        failed = sorted({rank for e, _, ranks in outcomes if e for rank in ranks})
        first, free = reported[0]
        fix = "Fix: the cause above; then continue with --resume."
        if first.startswith(_NO_SPACE_MESSAGE):
            needed = self._needed_bytes(rt.all_gather_object(job.sizes, group=self._group))
            was_free = f"{_mib(free)} was free then" if free >= 0 else "the free space is unknown"
            first += f"; {was_free}, and a checkpoint of this run takes about {_mib(needed)}"
            fix = (
                "Fix: free disk space (or point run.out_dir elsewhere, or keep fewer checkpoints with "
                "checkpoint.keep_last) and continue with --resume."
            )
        raise CheckpointWriteError(
            f"saving checkpoint {job.final} failed on rank(s) {failed}: {first}. "
            f"Nothing was committed and older checkpoints are intact. {fix}"
        )

    def _needed_bytes(self, sizes: list[dict[str, tuple[int, bool]]]) -> int:
        """What a checkpoint of this run takes on disk: the newest committed one's size, or else an estimate
        from the tensors (shards add up; DCP writes a replicated tensor once)."""
        committed = list_checkpoints(self.run_dir)
        if committed:
            return sum(p.stat().st_size for p in committed[-1].rglob("*") if p.is_file() and not p.is_symlink())
        shards = sum(size for per_rank in sizes for size, sharded in per_rank.values() if sharded)
        replicated = {name: size for per_rank in sizes for name, (size, sharded) in per_rank.items() if not sharded}
        return shards + sum(replicated.values())


def _describe_error(error: BaseException, staging: Path, writing: int) -> str:
    """The root cause of this rank's failed write (`writing` bytes), with the path it concerns.

    DCP wraps each rank's exception in a CheckpointException and gathers the ranks' exceptions by
    pickling, which drops their causes: a full disk then shows only as the RuntimeError of torch's file
    writer ("unexpected pos ..."). So when no OSError is left to read, a file system with less room than
    this rank was writing counts as full."""
    cause = find_cause(error, OSError)
    if cause is not None and cause.errno in _NO_SPACE:
        return f"{_NO_SPACE_MESSAGE} writing {cause.filename or staging}"
    if cause is not None:
        return f"{cause.strerror or cause} ({cause.filename or staging})"
    first = _first_failure(error)
    what = f"{type(first).__name__}: {str(first).splitlines()[0] if str(first) else ''}"
    if 0 <= _free_bytes(staging.parent) < writing:
        return f"{_NO_SPACE_MESSAGE} writing {staging} ({what})"
    return what


def _free_bytes(folder: Path) -> int:
    """Free bytes on the file system of `folder` (-1: unknown, e.g. the folder is gone)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return -1


def _first_failure(error: BaseException) -> BaseException:
    """The exception inside DCP's CheckpointException wrappers (one rank's)."""
    from torch.distributed.checkpoint.api import CheckpointException

    while isinstance(error, CheckpointException) and error.failures:
        error = next(iter(error.failures.values()))[0]
    return error


def _tensor_sizes(state: Any, prefix: str = "") -> dict[str, tuple[int, bool]]:
    """Name -> (bytes this rank holds, whether it is a shard) of every tensor in a nested state dict."""
    if isinstance(state, dict):
        return {k: v for key, value in state.items() for k, v in _tensor_sizes(value, f"{prefix}{key}.").items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, value in enumerate(state) for k, v in _tensor_sizes(value, f"{prefix}{i}.").items()}
    if isinstance(state, torch.Tensor):
        sharded = is_dtensor(state)  # this rank holds its local shard
        local = state.to_local() if is_dtensor(state) else state
        return {prefix.rstrip("."): (local.numel() * local.element_size(), sharded)}
    return {}


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"
