"""Where a step's time and memory go: torch.profiler traces, NVTX phase ranges, and a CUDA memory snapshot
written when a rank runs out of memory. All of it is off by default ([profile] in the config).

The training step runs its phases (data, forward_backward, optimizer, log) inside `phase(name)`: a trace
range when a trace is being recorded or NVTX is on, and always the step-time breakdown's marks (the
profiler's `clock`, metrics/breakdown.py), so the step's code carries no timing of its own.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from trainmesh.config.schema import ProfileConfig, profiled_ranks
from trainmesh.core.files import make_dirs
from trainmesh.core.logging import get_logger
from trainmesh.metrics.breakdown import StepClock

log = get_logger(__name__)

PHASES = ("data", "forward_backward", "optimizer", "log")
BREAKDOWN: dict[str, tuple[str | None, str | None]] = {
    "data": ("data", None),  # lasts until the first forward: the count's all-reduce is issued in it too
    "forward_backward": (None, None),  # each pass marks "forward" (`forward_passes`), the strategy "backward"
    "optimizer": ("optimizer", "other"),
    "log": (None, None),  # "other" goes on
}
"""For each of PHASES: the breakdown's phase that begins with it, and the one that begins when it ends (None: none)."""
MEMORY_VIEWER = "https://pytorch.org/memory_viz"
_UNMARKED = contextlib.nullcontext()
T = TypeVar("T")
_HISTORY_ENTRIES = 100_000  # allocation events kept for the snapshot (a ring buffer)


def _out_of_memory(error: BaseException | None) -> bool:
    """Whether `error` is, or was caused by, running out of GPU memory (a pipeline stage or the compiler
    re-raises it wrapped in another exception)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


class StepProfiler:
    """One per rank, around the training loop: `with StepProfiler(...) as prof:` ... `prof.step()` after
    each optimizer step, `with prof.phase("optimizer"):` around a phase of it."""

    def __init__(self, cfg: ProfileConfig, run_dir: Path, rank: int, device: torch.device) -> None:
        ranks = profiled_ranks(cfg.ranks)
        self.run_dir, self.rank = run_dir, rank
        self.recording = cfg.enabled and (ranks is None or rank in ranks)
        self.nvtx = cfg.nvtx and device.type == "cuda"
        self.oom_snapshot = cfg.oom_snapshot and device.type == "cuda"
        self.cuda = device.type == "cuda"
        self.clock = StepClock(device)
        """The per-phase step times of the metrics (metrics/breakdown.py)."""
        self._profiler: profile | None = None
        if self.recording:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
            self._profiler = profile(
                activities=activities,
                schedule=schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=cfg.repeat),
                on_trace_ready=self._trace_ready,
                record_shapes=cfg.record_shapes,
                profile_memory=cfg.profile_memory,
                with_stack=cfg.with_stack,
            )

    def __enter__(self) -> StepProfiler:
        if self.oom_snapshot:
            # Documented in "Understanding CUDA Memory Usage" (pytorch.org/docs/stable/torch_cuda_memory.html).
            torch.cuda.memory._record_memory_history(max_entries=_HISTORY_ENTRIES)
        if self._profiler is not None:
            self._profiler.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if _out_of_memory(error):
                self._on_out_of_memory()  # first: the allocator's state as close to the failure as can be
            if self._profiler is not None:
                self._profiler.stop()  # a cycle still recording is written now
        except Exception:
            if error is None:
                raise
            log.exception("rank %d: could not write its profile after an error (the error follows)", self.rank)
        finally:
            if self.oom_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None)

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def mark(self, phase: str) -> None:
        """The breakdown's `phase` (metrics/breakdown.py) begins now (the strategy marks "backward" and "comm")."""
        self.clock.mark(phase)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """One of PHASES: its breakdown marks (BREAKDOWN) and, when recording or NVTX is on, a trace range."""
        begins, then = BREAKDOWN[name]
        if begins is not None:
            self.clock.mark(begins)
        with self._traced(name):
            yield
        if then is not None:
            self.clock.mark(then)

    def forward_passes(self, micro_batches: Iterable[T]) -> Iterator[T]:
        """`micro_batches`, each pass over one begun as the breakdown's "forward" (the one before ended in
        "backward" or "comm": a phase lasts until the next mark)."""
        for batch in micro_batches:
            self.clock.mark("forward")
            yield batch

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """The breakdown's "sync", within a forward pass: waiting for the step's all-reduce of the target count."""
        self.clock.mark("sync")
        yield
        self.clock.mark("forward")

    @contextlib.contextmanager
    def pause(self, name: str) -> Iterator[None]:
        """An evaluation or a checkpoint (the breakdown's PAUSES): time outside the steps, then "other" again."""
        self.clock.mark(name)
        yield
        self.clock.mark("other")

    def _traced(self, name: str) -> contextlib.AbstractContextManager[None]:
        """A trace range: nothing at all (one shared no-op) unless recording or NVTX is on."""
        if not (self.recording or self.nvtx):
            return _UNMARKED
        return self._marked(name)

    @contextlib.contextmanager
    def _marked(self, name: str) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.recording:
                stack.enter_context(record_function(f"trainmesh.{name}"))
            if self.nvtx:
                stack.enter_context(torch.cuda.nvtx.range(f"trainmesh.{name}"))
            yield

    def _trace_ready(self, prof: Any) -> None:
        folder = make_dirs(self.run_dir, "profile", f"rank_{self.rank}")
        started = time.time()
        tensorboard_trace_handler(str(folder), worker_name=f"rank_{self.rank}")(prof)
        written = [p for p in folder.glob("*.pt.trace.json") if p.stat().st_mtime >= started - 1]
        where = max(written, key=lambda p: p.stat().st_mtime) if written else folder
        log.info(
            "profiler trace of rank %d: %s (open it in https://ui.perfetto.dev, or: tensorboard --logdir %s)",
            self.rank,
            where,
            folder.parent,
        )

    def _on_out_of_memory(self) -> None:
        if not self.oom_snapshot:
            log.error(
                "rank %d ran out of GPU memory. To see what held it, run again with --profile.oom_snapshot=true: "
                "a memory snapshot is then written into the run directory for %s",
                self.rank,
                MEMORY_VIEWER,
            )
            return
        path = make_dirs(self.run_dir, "memory") / f"oom_rank_{self.rank}.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        log.error(
            "rank %d ran out of GPU memory; memory snapshot: %s (drop it onto %s)", self.rank, path, MEMORY_VIEWER
        )
