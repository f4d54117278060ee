"""What watches a training run from outside its arithmetic: the stop signals (preemption.py), the stall
watchdog (watchdog.py), the fault-injection test hook (trainmesh.train.faults) and the parity probe
(parity.py). The worker gathers them once in `RunHooks`; set-up binds them to the run's model as
`StepHooks`, which the loop calls at each point of a step. Each part defaults to a no-op, so a library
caller of `train()` passes nothing, and the loop never reads the environment per step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from trainmesh.runtime.runtime import Runtime
from trainmesh.train.faults import FaultSchedule
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
    faults: FaultSchedule = field(default_factory=FaultSchedule.none)
    """The faults TRAINMESH_FAULT plans for this rank (tests only)."""
    probe: ParityProbe | None = None
    """Fingerprints of every step for `trainmesh check --parity` (TRAINMESH_PARITY_RECORD); None: off."""
    started: Callable[[int], None] = lambda step: None
    """Called on every rank once the run starts at this step, its checkpoint loaded (or step 0): the worker then
    makes the run's config.toml this launch's config (collective)."""


@dataclass(frozen=True)
class StepHooks:
    """The run's hooks bound to the model they watch, in the order a step meets them. The probe's three calls
    come at the same points on every rank (its collectives must line up)."""

    run: RunHooks
    runtime: Runtime
    model: nn.Module
    """The parameters outside any wrapper (Session.raw_model)."""
    max_norm: float
    """train.grad_clip: the probe divides the clipping back out of the gradients it records."""

    def before_step(self) -> None:
        """Before anything of a step: the probe's first record (the initial weights) and its collectives."""
        if self.run.probe is not None:
            self.run.probe.before_step(self.runtime, self.model)

    def before_data(self, step: int) -> None:
        """Optimizer step `step` (from 1) is about to read its batch."""
        self.run.faults.inject(step, "data")  # a stuck data loader, say

    def loss(self, loss_fn: F, step: int) -> F:
        """The loss function for optimizer step `step` (poisoned with NaN by a kind=nan fault)."""
        return self.run.faults.loss(loss_fn, step)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank received SIGTERM or Ctrl-C (the step adds it to its all-reduce)."""
        return self.run.preemption.requested

    def gradients(self, step: int, grad_norm: torch.Tensor) -> None:
        """The gradients are synchronised, unscaled and clipped (`grad_norm`: the norm before clipping)."""
        if self.run.probe is not None:
            self.run.probe.gradients(step, self.runtime, self.model, grad_norm, self.max_norm)

    def after_step(self, step: int, loss: torch.Tensor, targets: float, stepped: bool | torch.Tensor) -> None:
        """Optimizer step `step` returned: the probe records the weights after it and its loss (`loss`: this
        rank's summed loss; `targets`: the global batch's target count; `stepped`: on the device when the optimizer
        decided there, which the probe reads at once)."""
        if self.run.probe is not None:
            self.run.probe.after_step(step, self.runtime, self.model, loss, targets, bool(stepped))

    def step_done(self, step: int) -> None:
        """The run's state has advanced to step `step`."""
        self.run.watchdog.beat(step)
        self.run.faults.inject(step, "step")

    def progress(self, step: int) -> None:
        """An evaluation or a checkpoint finished (progress too, for the watchdog)."""
        self.run.watchdog.beat(step)

    @property
    def stop_vote(self) -> int:
        """This rank's stop request: 0 none, 1 SIGTERM, 2 Ctrl-C (PreemptionWatch.vote)."""
        return self.run.preemption.vote
