"""What watches a training run from outside its arithmetic, as one object the worker builds once and the
loop calls once per phase: the stop signals (preemption.py), the stall watchdog (watchdog.py), the
fault-injection test hook (trainmesh.train.faults) and the parity probe (parity.py). Each part defaults to a
no-op, so a library caller of `train()` passes nothing, and the loop never reads the environment per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from trainmesh.train.faults import FaultPlan
from trainmesh.train.parity import ParityProbe
from trainmesh.train.preemption import PreemptionWatch
from trainmesh.train.watchdog import StallWatchdog

F = TypeVar("F", bound=Callable[..., Any])


@dataclass
class RunHooks:
    preemption: PreemptionWatch = field(default_factory=PreemptionWatch)
    """SIGTERM / Ctrl-C requests (a watch that is not installed never reports one)."""
    watchdog: StallWatchdog = field(default_factory=StallWatchdog.off)
    """Told of every finished step, evaluation and checkpoint."""
    faults: FaultPlan = field(default_factory=FaultPlan.none)
    """The faults TRAINMESH_FAULT plans for this rank (tests only)."""
    probe: ParityProbe | None = None
    """Fingerprints of every step for `trainmesh check --parity` (TRAINMESH_PARITY_RECORD); None: off."""
    started: Callable[[int], None] = lambda step: None
    """Called on every rank once the run starts at this step, its checkpoint loaded (or step 0): the worker then
    makes the run's config.toml this launch's config (collective)."""

    def before_data(self, step: int) -> None:
        """Optimizer step `step` (from 1) is about to read its batch."""
        self.faults.inject(step, "data")  # a stuck data loader, say

    def loss(self, loss_fn: F, step: int) -> F:
        """The loss function for optimizer step `step` (poisoned with NaN by a kind=nan fault)."""
        return self.faults.loss(loss_fn, step)

    def after_step(self, step: int) -> None:
        """Optimizer step `step` is done."""
        self.watchdog.beat(step)
        self.faults.inject(step, "step")

    def progress(self, step: int) -> None:
        """An evaluation or a checkpoint finished (progress too, for the watchdog)."""
        self.watchdog.beat(step)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank received SIGTERM or Ctrl-C (the loop adds it to its every-step all-reduce)."""
        return self.preemption.requested

    @property
    def stop_vote(self) -> int:
        return self.preemption.vote
