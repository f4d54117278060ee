"""The metrics window: what the loop logs every `run.log_every` steps (loss, throughput, MFU, memory).

Logging costs no collective of its own. The loss stays on the device, and each step's loss rides on the
next step's all-reduce, the one that counts that step's targets anyway (`Runtime.all_reduce_async`'s
`carry`). So a window that closes at step k is complete one step later, when step k+1's all-reduce has
brought in step k's loss: its record is written then (at the end of training and before a checkpoint, an
all-reduce of its own brings the last loss in). Time spent evaluating or checkpointing is left out of the
window's throughput.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from trainmesh.core.batch import BatchPlan
from trainmesh.metrics.mfu import Peak, mfu
from trainmesh.runtime.runtime import PendingReduce, Runtime


@dataclass
class Record:
    """A closed window: its metrics, and the all-reduces that carry (or will carry) its loss."""

    step: int
    metrics: dict[str, float]
    targets: float
    reduces: list[PendingReduce] = field(default_factory=list)

    def complete(self, last_loss: float = 0.0) -> Record:
        """Fill in the loss: summed over ranks and steps / targets over ranks and steps (`last_loss`: the
        final step's loss when no further step carried it)."""
        summed = sum(r.carried() for r in self.reduces) + last_loss
        self.metrics["loss"] = summed / self.targets if self.targets else math.nan
        return self


class MetricsWindow:
    def __init__(self, plan: BatchPlan, runtime: Runtime, flops_per_token: float, peak: Peak | None) -> None:
        self.plan, self.runtime, self.flops_per_token, self.peak = plan, runtime, flops_per_token, peak
        self.unsent = torch.zeros((), dtype=torch.float64, device=runtime.device)  # loss no reduce carried yet
        self.reduces: list[PendingReduce] = []  # this window's, each carrying its previous step's loss
        self.targets = 0.0  # over all ranks
        self.steps = 0
        self.skipped = 0  # steps skipped (non-finite gradients, fp16 overflow) in the whole run
        self.start = time.perf_counter()
        self.closed: Record | None = None  # closed at the previous step; its last step's loss still to come

    def carry(self) -> torch.Tensor:
        """This rank's loss that no all-reduce has carried yet, for the next step's (the sum starts over)."""
        out, self.unsent = self.unsent, torch.zeros_like(self.unsent)
        return out

    def add(
        self, reduce: PendingReduce, step_loss: torch.Tensor, global_targets: float, stepped: bool
    ) -> Record | None:
        """One optimizer step, whose all-reduce `reduce` carried the loss of the steps before it. Returns the
        window closed at the previous step, now complete, if there is one."""
        done, self.closed = self.closed, None
        if done is not None:
            done.reduces.append(reduce)  # it carried the closed window's last step
        else:
            self.reduces.append(reduce)
        if stepped:  # the logged loss is that of the steps taken
            self.unsent += step_loss
            self.targets += global_targets
        else:
            self.skipped += 1
        self.steps += 1
        return done.complete() if done is not None else None

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint) out of the window's time."""
        self.start += seconds

    def close(self, step: int, lr: float, grad_norm: torch.Tensor) -> None:
        """End the window at `step` (its record completes with the next step, or `flush`); start the next."""
        now = time.perf_counter()
        elapsed = now - self.start
        metrics = {
            "lr": lr,
            "grad_norm": float(grad_norm),
            "step_time_ms": 1000 * elapsed / self.steps,
            "samples_per_s": self.plan.global_batch * self.steps / elapsed,
            "skipped_steps": self.skipped,
        }
        if self.plan.tokens_per_sample:
            tokens_per_s = self.plan.tokens_per_step * self.steps / elapsed
            metrics["tokens_per_s"] = tokens_per_s
            value = mfu(self.flops_per_token, tokens_per_s / self.runtime.devices, self.peak)
            if value is not None:
                metrics["mfu"] = value
        if self.runtime.device.type == "cuda":
            metrics["peak_mem_gb"] = torch.cuda.max_memory_allocated(self.runtime.device) / 2**30
        self.closed = Record(step, metrics, self.targets, self.reduces)
        self.reduces, self.targets, self.steps, self.start = [], 0.0, 0, now

    def flush(self) -> Record | None:
        """Collective: the window closed at the last step, completed now by an all-reduce of the loss no step
        has carried yet (at the end, and before a checkpoint, so that a resume finds every record before it)."""
        done, self.closed = self.closed, None
        if done is None:
            return None
        return done.complete(float(self.runtime.all_reduce(self.carry(), "sum")))
