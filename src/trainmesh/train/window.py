"""The metrics window: what the loop logs every `run.log_every` steps (loss, throughput, MFU, memory, the step
breakdown per rank, host and device figures). Its loss and phase times ride on the all-reduce of the step after the
window closes, and are read back then: once a window, never inside other steps.

Details: docs/internals.md#trainwindowpy
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field

import torch

from trainmesh.core.batch import BatchSplit
from trainmesh.core.logging import get_logger
from trainmesh.metrics.breakdown import COMPUTE, PAUSES, PHASES, StepClock
from trainmesh.metrics.mfu import Peak, mfu
from trainmesh.metrics.monitor import Monitor
from trainmesh.runtime.collectives import PendingReduce
from trainmesh.runtime.runtime import Runtime

log = get_logger(__name__)

STRAGGLER_RATIO = 1.2
"""A rank whose compute time per step is this many times the median's ..."""
STRAGGLER_WINDOWS = 3
"""... in this many windows in a row is reported as a straggler ..."""
STRAGGLER_MIN_MS = 1.0
"""... when it is also this much slower (millisecond steps jitter by more than 20%)."""


@dataclass
class Record:
    """A closed window: its metrics, completed by the all-reduce that carries its loss and the ranks' times."""

    step: int
    metrics: dict[str, float]
    targets: float
    rank_times: list[list[float]] = field(default_factory=list)
    """Per rank: its mean ms per step in each of PHASES (filled in by `complete`)."""
    compute_ms: list[float] = field(default_factory=list)
    """Per rank: its mean ms per step in the COMPUTE phases (filled in by `complete`)."""

    def complete(self, carried: list[float]) -> Record:
        """Fill in the loss, summed over ranks and steps / targets over ranks and steps, and every rank's phase
        times, from the `carried` values of the all-reduce that completes the window (`MetricsWindow.carry`)."""
        self.metrics["loss"] = carried[0] / self.targets if self.targets else math.nan
        slots = carried[1:]  # each rank's times, in its own slot
        self.rank_times = [slots[i : i + len(PHASES)] for i in range(0, len(slots), len(PHASES))]
        self.compute_ms = compute = [sum(t[PHASES.index(p)] for p in COMPUTE) for t in self.rank_times]
        if compute:
            slowest = max(range(len(compute)), key=compute.__getitem__)
            median = statistics.median(compute)
            self.metrics |= {
                "slowest_rank": slowest,
                "slowest_compute_ms": compute[slowest],
                "median_compute_ms": median,
                "compute_spread": (compute[slowest] - min(compute)) / median if median > 0 else 0.0,
            }
        return self


class MetricsWindow:
    def __init__(
        self,
        split: BatchSplit,
        runtime: Runtime,
        flops_per_token: float,
        peak: Peak | None,
        clock: StepClock,
        monitor: Monitor | None = None,
    ) -> None:
        self.split, self.runtime, self.flops_per_token, self.peak = split, runtime, flops_per_token, peak
        self.clock, self.monitor = clock, monitor
        self.unsent = torch.zeros((), dtype=torch.float64, device=runtime.device)  # the window's loss, on the device
        self.targets = 0.0  # over all ranks
        self.steps = 0
        self.skipped = 0  # steps skipped (non-finite gradients, fp16 overflow) in the whole run
        self.start = time.perf_counter()
        self.closed: Record | None = None  # closed at the previous step; its loss still to come
        self.own_times: list[float] = []  # this rank's ms per step in each phase, for the closed record
        self.run_totals_s = dict.fromkeys((*PHASES, *PAUSES), 0.0)  # this rank's, over the whole run
        self._slow_windows = [0] * runtime.world_size

    def carry(self) -> torch.Tensor | None:
        """What the next step's all-reduce carries: once a window has closed, this rank's loss over it (the sum
        starts over) and its phase times in its slot; else nothing (the loss adds up on the device)."""
        if self.closed is None:
            return None
        loss, self.unsent = self.unsent, torch.zeros_like(self.unsent)
        slots = torch.zeros(self.runtime.world_size * len(PHASES), dtype=torch.float64)
        slots[self.runtime.rank * len(PHASES) : (self.runtime.rank + 1) * len(PHASES)] = torch.tensor(
            self.own_times, dtype=torch.float64
        )
        return torch.cat([loss.reshape(1), slots.to(loss.device)])

    def take(self, reduce: PendingReduce) -> Record | None:
        """A step's all-reduce. Returns the window closed at the previous step, completed by what this one carried
        (read back now: once a window), if there is one."""
        done, self.closed = self.closed, None
        if done is None:
            return None
        return self._checked(done.complete(reduce.carried()))

    def count(self, step_loss: torch.Tensor, global_targets: float, stepped: bool) -> None:
        """A step's loss and targets, once it is known whether it was taken (the logged loss is that of the steps
        taken)."""
        if stepped:
            self.unsent += step_loss
            self.targets += global_targets
        else:
            self.skipped += 1
        self.steps += 1

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint) out of the window's time."""
        self.start += seconds

    def close(self, step: int, lr: float, grad_norm: float) -> None:
        """End the window at `step` (its record completes with the next step, or `flush`); start the next."""
        now = time.perf_counter()
        elapsed = now - self.start
        times_s = self.clock.take()
        for phase, seconds in times_s.items():
            self.run_totals_s[phase] += seconds
        self.own_times = [1000 * times_s[p] / self.steps for p in PHASES]
        metrics = {
            "lr": lr,
            "grad_norm": grad_norm,
            "step_time_ms": 1000 * elapsed / self.steps,
            "samples_per_s": self.split.global_batch * self.steps / elapsed,
            "skipped_steps": self.skipped,
        }
        metrics |= {f"time_{p}_ms": ms for p, ms in zip(PHASES, self.own_times, strict=True)}
        metrics |= {f"time_{p}_ms": 1000 * times_s[p] for p in PAUSES if times_s[p] > 0}  # totals, not per step
        if self.split.tokens_per_sample:
            tokens_per_s = self.split.tokens_per_step * self.steps / elapsed
            metrics["tokens_per_s"] = tokens_per_s
            value = mfu(
                self.flops_per_token,
                tokens_per_s / (self.runtime.world_size * self.runtime.strategy.devices_per_process),
                self.peak,
            )
            if value is not None:
                metrics["mfu"] = value
        if self.runtime.device.type == "cuda":
            metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.runtime.device) / 2**30
        if self.monitor is not None:
            metrics |= self.monitor.take()
        self.closed = Record(step, metrics, self.targets)
        self.targets, self.steps, self.start = 0.0, 0, now

    def abort(self, reduce: PendingReduce | None) -> Record | None:
        """The window closed at the last step, completed by the all-reduce of a step that then failed (it carried
        that window; `reduce` None: no step carried it, so `flush`)."""
        if reduce is None or self.closed is None:
            return self.flush()
        done, self.closed = self.closed, None
        return self._checked(done.complete(reduce.carried()))

    def flush(self) -> Record | None:
        """Collective: the window closed at the last step, completed now by an all-reduce of its own (at the end,
        and before a checkpoint, so that a resume finds every record before it)."""
        carry = self.carry()
        if self.closed is None or carry is None:
            return None
        carried = self.runtime.all_reduce(carry, "sum").reshape(-1).tolist()
        done, self.closed = self.closed, None
        return self._checked(done.complete(carried))

    def _checked(self, record: Record) -> Record:
        """Warn (rank 0) of a rank whose compute time stays STRAGGLER_RATIO × the median's or more."""
        compute = record.compute_ms
        if not compute:
            return record
        median = statistics.median(compute)
        for rank, ms in enumerate(compute):
            slow = ms >= STRAGGLER_RATIO * median and ms - median >= STRAGGLER_MIN_MS
            self._slow_windows[rank] = self._slow_windows[rank] + 1 if slow else 0
            if self._slow_windows[rank] == STRAGGLER_WINDOWS and self.runtime.is_main_process:
                log.warning(
                    "rank %d is a straggler: %.1f ms of compute per step against the median rank's %.1f ms, in %d "
                    "logging windows in a row up to step %d (data, forward, optimizer and loop time; the other ranks "
                    "wait for it in every collective). Check that rank's host and its data loading.",
                    rank,
                    ms,
                    median,
                    STRAGGLER_WINDOWS,
                    record.step,
                )
        return record
