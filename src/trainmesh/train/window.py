"""The metrics window: what the loop logs every `run.log_every` steps (loss, throughput, MFU, memory).

The loss is kept on the device and reduced over ranks once per window, so logging costs one
all-reduce per window, not a host synchronisation per step. Time spent evaluating or checkpointing is
excluded from the window's throughput.
"""

from __future__ import annotations

import math
import time

import torch

from trainmesh.core.batch import BatchPlan
from trainmesh.metrics.mfu import Peak, mfu
from trainmesh.runtime.runtime import Runtime


class MetricsWindow:
    def __init__(self, plan: BatchPlan, runtime: Runtime, flops_per_token: float, peak: Peak | None) -> None:
        self.plan, self.runtime, self.flops_per_token, self.peak = plan, runtime, flops_per_token, peak
        self.loss = torch.zeros((), dtype=torch.float64, device=runtime.device)  # this rank's summed loss
        self.targets = 0.0  # over all ranks
        self.steps = 0
        self.skipped = 0  # steps skipped (non-finite gradients, fp16 overflow) in the whole run
        self.start = time.perf_counter()

    def add(self, step_loss: torch.Tensor, global_targets: float, stepped: bool) -> None:
        """One optimizer step; the logged loss is that of the steps taken."""
        if stepped:
            self.loss += step_loss
            self.targets += global_targets
        else:
            self.skipped += 1
        self.steps += 1

    def pause(self, seconds: float) -> None:
        """Leave `seconds` (an evaluation, a checkpoint) out of the window's time."""
        self.start += seconds

    def close(self, lr: float, grad_norm: torch.Tensor) -> dict[str, float]:
        """Collective: the window's metrics (the loss summed over ranks / targets over ranks); starts the next."""
        summed = float(self.runtime.all_reduce(self.loss, "sum"))  # every rank, whatever the targets
        loss = summed / self.targets if self.targets else math.nan
        now = time.perf_counter()  # logging after this is timed into the next window, like any step cost
        elapsed = now - self.start
        metrics = {
            "loss": loss,
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
        self.loss.zero_()
        self.targets, self.steps, self.start = 0.0, 0, now
        return metrics
