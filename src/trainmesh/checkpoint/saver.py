"""Writing checkpoints: every rank in parallel, committed atomically, optionally in the background.

One save, in order (the layout is described in dcp.py):
    1. rank 0 creates `step_N.tmp-*` (a committed `step_N` is never overwritten)
    2. DCP writes the model and optimizer shards; each rank writes its RNG state; rank 0 the trainer state
    3. every rank reports whether its writes succeeded; if any failed (a full disk, say), every rank
       raises the same `CheckpointWriteError`, the staging folder is removed and older checkpoints stay
    4. the manifest: every file hashed and fsynced, in parallel over the ranks
    5. the commit: rank 0 renames the folder to `step_N`, updates `latest`, rotates (keep_last)

With `checkpoint.async_save`, step 1 and a copy of the state to CPU memory (DCP's async_save staging)
happen at the step boundary; steps 2-5 run in a background thread, over a second gloo process group so
that their collectives never interleave with training's. At most one save is in flight: the next save,
and the end of training, wait for it, so the final checkpoint is committed and durable before the
process exits, and an error in the background is raised on every rank at the same point.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from trainmesh.checkpoint.catalog import rotate, staging_dir, step_dir, write_latest
from trainmesh.checkpoint.dcp import TRAINER_STATE, TrainerState, rng_state, single_process_quiet
from trainmesh.checkpoint.manifest import fsync_dir, write_json_durably, write_manifest
from trainmesh.faults import maybe_inject
from trainmesh.runtime.logging import get_logger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written; raised on every rank alike. Older checkpoints are intact."""


@dataclass
class _Save:
    """One save, captured at the step boundary."""

    step: int
    staging: Path
    final: Path
    trainer_state: dict[str, Any]
    rng: dict[str, Any]
    state_dict: dict[str, Any] | None  # written synchronously, or
    written: Future[Any] | None  # being written by DCP's async_save


class Checkpointer:
    """Saves checkpoints of one run. Collective: every rank creates it and calls `save` together."""

    def __init__(self, run_dir: Path, runtime: Runtime, keep_last: int = 0, background: bool = False) -> None:
        self.run_dir, self.runtime, self.keep_last = run_dir, runtime, keep_last
        self.background = background
        self._group: ProcessGroup | None = runtime.new_group() if background else None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="trainmesh-checkpoint") if background else None
        # Kept across saves: it reuses its CPU copies of the same tensors (pinned for GPUs), so staging is
        # a memory copy, not fresh allocations page-faulted in each time.
        pinned = torch.cuda.is_available()
        self._stager = DefaultStager(StagingOptions(pinned, False, False, False)) if background else None
        self._pending: Future[None] | None = None

    def save(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: TrainerState) -> Path:
        """Save (or start saving) `state.step`; returns the folder the checkpoint is committed to."""
        self.wait()  # one save in flight at most
        rt = self.runtime
        final = step_dir(self.run_dir, state.step)
        if any(p.is_symlink() for p in (final.parent, final.parent.parent)):
            raise ValueError(
                f"{final.parent} is or lies in a symlink: checkpoints are written only inside the run "
                "directory. Fix: make run.out_dir/<run>/checkpoints a real directory."
            )
        staging = staging_dir(final)
        if rt.broadcast_object(final.exists() if rt.is_main_process else False):
            raise FileExistsError(f"checkpoint {final} already exists; a committed checkpoint is never overwritten")
        if rt.is_main_process:
            shutil.rmtree(staging, ignore_errors=True)  # leftover of a crashed save of this step
            (staging / "rng").mkdir(parents=True)
        rt.barrier()
        model_state, optim_state = rt.strategy.state_dicts(model, optimizer)
        tensors = {"model": model_state, "optim": optim_state}
        job = _Save(state.step, staging, final, asdict(state), rng_state(), None, None)
        if self._executor is None:
            job.state_dict = tensors
            self._complete(job)
            return final
        with single_process_quiet():  # copies to CPU memory now; writes in DCP's thread
            written = dcp.async_save(
                tensors, checkpoint_id=str(staging), process_group=self._group, async_stager=self._stager
            )
            job.written = cast(Future, written)
        self._pending = self._executor.submit(self._complete, job)
        return final

    def wait(self) -> None:
        """Until the save in flight is committed (re-raising its error, on every rank alike)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()
        if self._stager is not None:
            self._stager.close()

    def _complete(self, job: _Save) -> None:
        """Steps 2-5 of the module docstring (in the background thread for async saves)."""
        rt = self.runtime

        def write_mine() -> None:
            if job.state_dict is not None:
                with single_process_quiet():
                    dcp.save(job.state_dict, checkpoint_id=str(job.staging))
            if job.written is not None:
                job.written.result()
            torch.save(job.rng, job.staging / "rng" / f"rank_{rt.rank}.pt")
            maybe_inject(job.step, "checkpoint", rt.rank, self.run_dir)  # test hook: fail before the commit
            if rt.is_main_process:
                write_json_durably(job.staging / TRAINER_STATE, job.trainer_state)

        self._agreed(write_mine, job)
        write_manifest(job.staging, rt, self._group)  # hashes and fsyncs everything, in parallel over the ranks
        if rt.is_main_process:
            job.staging.rename(job.final)  # the commit
            fsync_dir(job.final.parent)
            write_latest(self.run_dir, job.final)
            for old in rotate(self.run_dir, self.keep_last):
                log.info("removed old checkpoint %s (checkpoint.keep_last=%d)", old, self.keep_last)
            log.info("saved checkpoint %s", job.final)
        rt.barrier(self._group)

    def _agreed(self, write: Callable[[], None], job: _Save) -> None:
        """Run this rank's writes; if any rank's failed, fail on every rank with the same error (a rank
        that raised alone would leave the others waiting in the next collective until the timeout)."""
        try:
            write()
            error = None
        except (OSError, CheckpointException) as e:
            error = f"{type(e).__name__}: {e}"
        errors = self.runtime.all_gather_object(error, group=self._group)
        failed = {rank: e for rank, e in enumerate(errors) if e is not None}
        if not failed:
            return
        if self.runtime.is_main_process:
            shutil.rmtree(job.staging, ignore_errors=True)
        rank, first = next(iter(failed.items()))
        raise CheckpointWriteError(
            f"saving checkpoint {job.final} failed on rank(s) {sorted(failed)}; rank {rank}: {first}. "
            "Nothing was committed and older checkpoints are intact. Fix: free disk space (or point run.out_dir "
            "elsewhere) and resume with --resume."
        )
