"""The training loop: `train_step` is one optimizer step (learning rate, batch, the all-reduce of the target count,
forward and backward, optimizer step); `train` runs the steps and logs, evaluates, checkpoints and stops on
schedule or on a signal.

Details: docs/internals.md#trainlooppy
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset
from torch.utils.data.dataloader import default_collate

from trainmesh.checkpoint import step_dir
from trainmesh.config.schema import Config
from trainmesh.core.batch import BatchSplit, loss_scale
from trainmesh.core.dtensors import implicit_replication, is_dtensor
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger
from trainmesh.data.workers import Batches
from trainmesh.metrics.breakdown import describe
from trainmesh.metrics.monitor import Monitor
from trainmesh.metrics.profiler import StepProfiler
from trainmesh.metrics.progress import ProgressBar
from trainmesh.recipes.base import Recipe
from trainmesh.runtime.collectives import PendingReduce
from trainmesh.runtime.optimizer import unwrap_optimizer
from trainmesh.runtime.runtime import Runtime
from trainmesh.train.hooks import RunHooks
from trainmesh.train.optim import lr_at, set_lr
from trainmesh.train.preemption import PreemptionWatch
from trainmesh.train.setup import Session, set_up
from trainmesh.train.window import MetricsWindow, Record

log = get_logger(__name__)


@dataclass
class TrainResult:
    steps: int
    train_loss: float
    val_loss: float
    initial_val_loss: float
    checkpoint: Path | None
    sample: str
    model: nn.Module
    preempted: bool = False
    exit_code: int = 0
    """0 when training ran to the end; after a stop, EXIT_PREEMPTED (SIGTERM) or EXIT_INTERRUPTED (Ctrl-C)."""


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor
    """This rank's loss summed over its micro-batches, shape () in float64 (on the device: no host sync)."""
    targets: int
    """Targets in the whole global batch."""
    grad_norm: torch.Tensor
    """The global gradient norm before clipping, shape ()."""
    lr: float
    stepped: bool | torch.Tensor
    """False when the step was skipped (fp16 overflow, or a non-finite gradient with nonfinite=skip). A bool tensor
    on the device when the optimizer took the decision there (`_step_if_finite`): the loop reads it later."""
    stop_votes: int
    """Ranks that received SIGTERM or Ctrl-C before this step."""
    reduce: PendingReduce
    """The step's all-reduce, which after a logging window also carried that window's loss (train/window.py)."""


def train(
    config: Config, split: BatchSplit, recipe: Recipe, runtime: Runtime, run_dir: Path, hooks: RunHooks | None = None
) -> TrainResult:
    """Train to `train.max_steps` with the batch `split` (a resolved Job's), or until a rank receives SIGTERM or
    Ctrl-C (then: checkpoint and stop). The [profile] section's traces record the steps it schedules; its
    out-of-memory snapshot covers everything from the model's construction on."""
    hooks = hooks or RunHooks()
    with StepProfiler(config.profile, run_dir, runtime.rank, runtime.device) as profiler:
        s = set_up(config, split, recipe, runtime, run_dir, hooks, profiler)
        hooks.started(s.start_step)
        try:
            with Monitor(runtime.device) as monitor:  # host and device figures for the metrics, off this thread
                window = MetricsWindow(split, runtime, s.flops_per_token, s.peak, profiler.clock, monitor)
                return _run(s, window)
        except BaseException as e:  # the records so far are written, and a tracker shows the run as failed
            if s.writer:
                s.writer.close("failed" if isinstance(e, Exception) else "stopped")
            raise


def train_step(s: Session, step: int, batches: Iterator[Any], carry: torch.Tensor | None) -> StepResult:
    """Optimizer step `step` (counted from 1): steps 1-5 of docs/internals.md#trainlooppy. `carry`: after
    a logging window, this rank's loss over it and phase times, reduced in the step's all-reduce (train/window.py)."""
    rt, hooks, timer, tcfg = s.runtime, s.hooks, s.profiler, s.config.train
    lr = lr_at(step - 1, s.config.optim, tcfg.max_steps)
    set_lr(s.optimizer, lr)
    with timer.phase("data"):
        hooks.before_data(step)
        micro_batches = [next(batches) for _ in range(s.split.accum_steps)]  # GPT: (tokens, targets), each (B, T)
    # Counted on the CPU, once per model replica (pipeline and tensor-parallel peers read the same batch).
    local_targets = sum(s.recipe.count_targets(mb) for mb in micro_batches) if rt.strategy.owns_loss else 0
    # In flight during the first forward: the batch's target count, how many ranks saw SIGTERM (integers of the host:
    # no device read), and after a logging window that window's loss and times (read back with its record).
    reduced = rt.all_reduce_async([local_targets, int(hooks.stop_requested)], carry)
    objective = replace(s.objective, loss=hooks.loss(s.objective.loss, step))

    def scale() -> float:  # summed loss -> its share of the global mean (core/batch.py), called after each forward
        with timer.waiting():  # the first call waits for the count: for the slowest peer's data, say
            count = reduced.result()[0]
        return loss_scale(count, rt.strategy.dp_size)

    step_loss = torch.zeros((), dtype=torch.float64, device=rt.device)  # this rank's summed loss, in float64
    with timer.phase("forward_backward"):
        for i, batch in enumerate(timer.forward_passes(micro_batches)):
            with rt.no_sync(s.model, enabled=i < s.split.accum_steps - 1):  # gradients sync on the last only
                step_loss += rt.strategy.forward_backward(
                    s.model, rt.to_device(batch), objective, scale, rt.precision, timer.mark
                )

    with timer.phase("optimizer"):
        grad_norm = rt.clip_grad_norm(s.model, s.optimizer, tcfg.grad_clip)  # unscales first; the pre-clip norm
        hooks.gradients(step, grad_norm)  # every strategy has synchronised them by now
        # The norm of the synchronised gradients is the same on every rank, and so is every decision here.
        stepped: bool | torch.Tensor
        if rt.precision.scales_loss:
            stepped = rt.step(s.optimizer)  # a GradScaler skips an overflowing step and lowers its scale
        elif _skips_on_device(s):
            stepped = _step_if_finite(rt, s.optimizer, grad_norm)  # no host read: the loop settles it later
        elif math.isfinite(float(grad_norm)):
            stepped = rt.step(s.optimizer)
        else:
            stepped = _nonfinite(s, step, step_loss, reduced)  # abort raises; skip returns False
        s.optimizer.zero_grad(set_to_none=True)
    global_targets, stop_votes = reduced.result()
    return StepResult(step_loss, global_targets, grad_norm, lr, stepped, stop_votes, reduced)


def _skips_on_device(s: Session) -> bool:
    """Whether the optimizer can skip a step on the device when the gradient norm is not finite: torch's fused
    optimizers take a `found_inf` flag (GradScaler's), and leave weights, moments and step counts as they were. Not
    where a strategy must hear of a skipped step as it happens (PowerSGD's error feedback)."""
    fused = getattr(unwrap_optimizer(s.optimizer), "_step_supports_amp_scaling", False)
    return bool(fused) and not s.runtime.strategy.hears_of_skips


def _step_if_finite(rt: Runtime, optimizer: torch.optim.Optimizer, grad_norm: torch.Tensor) -> torch.Tensor:
    """The optimizer step, taken on the device only where `grad_norm` is finite; returns that, on the device."""
    finite = torch.isfinite(grad_norm)
    if is_dtensor(finite):
        finite = finite.full_tensor()
    optimizer.found_inf = (~finite).to(torch.float32)  # type: ignore[attr-defined]
    try:
        with implicit_replication():  # one flag for every parameter, DTensors of any mesh too (tensor parallelism)
            rt.step(optimizer)
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]
    return finite


def _run(s: Session, window: MetricsWindow) -> TrainResult:
    """The steps from the session's start to `train.max_steps`, or to the step at which the ranks agree to stop."""
    tcfg, state, rt = s.config.train, s.state, s.runtime
    initial_val_loss = _validate(s) if state.step == 0 else math.nan
    if rt.is_main_process and state.step == 0:
        log.info("step 0: val loss %.4f", initial_val_loss)
    loop = _Loop(s, window, initial_val_loss)
    batches = Batches(s.loader)
    stop = 0  # the stop signal the ranks agreed on (PreemptionWatch.vote)
    window.start = time.perf_counter()  # the initial evaluation and the loader's start are no step's time
    try:
        for step in range(state.step + 1, tcfg.max_steps + 1):  # counted from 1
            result = loop.step(step, batches)
            loop.evaluate_and_save()
            # The stop protocol. A rank that received SIGTERM or Ctrl-C said so in this step's all-reduce, so every
            # rank learns it at this same step; they agree on which signal (Ctrl-C wins), checkpoint together unless
            # this step was just saved, and leave the loop. `finish` turns the signal into the exit code.
            if result.stop_votes:
                stop = int(rt.all_reduce(float(s.hooks.stop_vote), "max"))
                loop.bar.message(f"{_stop_reason(stop)}: stopping at step {state.step} with a checkpoint")
                if loop.checkpoint != step_dir(s.checkpointer.run_dir, state.step):
                    loop.save()
                break
    except BaseException:
        loop.bar.close()  # the traceback below the bar, not the bar redrawn after it
        raise
    finally:
        batches.close()  # its worker processes go now, however the loop ended (data/workers.py)
    return loop.finish(initial_val_loss, stop)


class _Loop:
    """What the loop keeps between steps and reports as it goes: rank 0's metrics records and progress bar, the
    last train and validation losses, the newest checkpoint, and how many steps in a row were skipped."""

    def __init__(self, s: Session, window: MetricsWindow, val_loss: float) -> None:
        self.s, self.window = s, window
        self.bar = ProgressBar(
            s.config.train.max_steps, s.state.step, enabled=s.runtime.is_main_process and s.config.run.progress
        )
        self.train_loss, self.val_loss = math.nan, val_loss
        self.checkpoint: Path | None = None
        self.skipped_in_a_row = 0
        self.unsettled: list[tuple[int, StepResult]] = []  # steps whose skip decision is still on the device

    def step(self, step: int, batches: Iterator[Any]) -> StepResult:
        """Optimizer step `step` inside the parity probe's records; then the run's state advances and the metrics
        window takes the step in (logging the window before it, now complete). A step decided on the device is
        settled (read back, a skip reported, an abort raised) at the next logging window, evaluation, checkpoint
        or stop: every rank settles the same steps at the same point."""
        s, window, tcfg = self.s, self.window, self.s.config.train
        log_now, grad_norm = False, math.nan
        try:
            s.hooks.before_step()  # the probe's collectives come before the step's own
            result = train_step(s, step, batches, window.carry())
            s.hooks.after_step(step, result.loss, result.targets, result.stepped)
            self.write_window(window.take(result.reduce))  # the previous window's, complete
            self.unsettled.append((step, result))
            log_now = step % s.config.run.log_every == 0 or step == tcfg.max_steps or bool(result.stop_votes)
            with s.profiler.phase("log"):
                if log_now or self._pauses_after(step) or not isinstance(result.stepped, torch.Tensor):
                    grad_norm = self.settle(with_norm=log_now)
        except NonFiniteError as e:  # every rank decided the same: the records of the steps before are kept
            self.write_window(window.abort(e.reduce))
            raise
        s.state.step = step
        s.state.samples_seen += s.split.global_batch
        s.hooks.step_done(step)
        if log_now:
            window.close(step, result.lr, grad_norm)
        s.profiler.step()
        return result

    def _pauses_after(self, step: int) -> bool:
        """Whether an evaluation or a checkpoint follows `step` (evaluate_and_save)."""
        tcfg, every = self.s.config.train, self.s.config.checkpoint.every
        return bool(tcfg.eval_every and step % tcfg.eval_every == 0) or bool(every and step % every == 0)

    def settle(self, with_norm: bool) -> float:
        """The unsettled steps, in order, as the step itself would have taken them had it read its decision: a
        skip is reported (or aborts, with nonfinite=abort or too many in a row) and the metrics window takes each
        step in. One read of the device for all of them (and, `with_norm`, the last step's gradient norm, which it
        returns; else NaN)."""
        s, steps = self.s, self.unsettled
        self.unsettled = []
        on_device = [_plain(r.stepped) for _, r in steps if isinstance(r.stepped, torch.Tensor)]
        numbers = on_device + ([_plain(steps[-1][1].grad_norm)] if with_norm else [])
        device = s.runtime.device
        read = torch.stack([n.to(device, torch.float32) for n in numbers]).tolist() if numbers else []
        norm = read.pop() if with_norm else math.nan
        for step, result in steps:
            taken = bool(read.pop(0)) if isinstance(result.stepped, torch.Tensor) else result.stepped
            if not taken and isinstance(result.stepped, torch.Tensor):  # skipped on the device: as the step would
                _nonfinite(s, step, result.loss, result.reduce)  # have said it (abort raises)
            self.skipped_in_a_row = 0 if taken else self.skipped_in_a_row + 1
            if self.skipped_in_a_row > s.config.train.max_skipped_steps:
                raise NonFiniteError(
                    f"{self.skipped_in_a_row} steps in a row were skipped (non-finite gradients), last: {step}",
                    result.reduce,
                )
            if not taken:
                s.runtime.strategy.on_skipped_step()  # e.g. PowerSGD's error feedback took in the non-finite gradient
            self.window.count(result.loss, result.targets, bool(taken))
        return norm

    def evaluate_and_save(self) -> None:
        """Evaluate and checkpoint when scheduled (not after the last step: `finish` does), outside the steps' time."""
        s, step, max_steps = self.s, self.s.state.step, self.s.config.train.max_steps
        pause_start = time.perf_counter()
        if s.config.train.eval_every and step % s.config.train.eval_every == 0 and step < max_steps:
            with s.profiler.pause("eval"):
                self.val_loss = _validate(s)
            self.bar.message(f"step {step}: val loss {self.val_loss:.4f}")
        if s.config.checkpoint.every and step % s.config.checkpoint.every == 0 and step < max_steps:
            self.save()
        s.hooks.progress(step)
        self.window.pause(time.perf_counter() - pause_start)

    def write_window(self, record: Record | None) -> None:
        """A complete metrics window: to rank 0's metrics files and progress bar."""
        if record is not None:
            self.train_loss = record.metrics["loss"]
            if self.s.writer:
                self.s.writer.write(record.step, record.metrics)
            self.bar.update(record.step, self.train_loss, record.metrics["lr"], record.metrics.get("tokens_per_s"))

    def save(self) -> None:
        self.write_window(
            self.window.flush()
        )  # the records up to a checkpoint are written before it: a resume continues
        with self.s.profiler.pause("checkpoint"):
            self.checkpoint = self.s.save()

    def finish(self, initial_val_loss: float, stop: int) -> TrainResult:
        """After the last step: the last window's record, and when training ran to the end the final evaluation,
        checkpoint and sample; then every file is closed."""
        s, state, rt = self.s, self.s.state, self.s.runtime
        self.write_window(self.window.flush())  # the last window: its final step's loss, which no further step carries
        self.bar.close()
        if rt.is_main_process:
            log.info("where the steps' time went on rank 0: %s", describe(self.window.run_totals_s))
        preempted = state.step < s.config.train.max_steps
        sample = ""
        if not preempted:
            self.val_loss = _validate(s)
            if s.config.checkpoint.final and state.step > s.start_step:  # the same decision on every rank
                self.save()
            s.hooks.progress(state.step)  # the final evaluation and save were progress too
            # The raw module shares the trained parameters and sits outside any DDP wrapper. Every rank runs
            # it (a sharded model's forward is collective); rank 0's result is the one reported.
            if rt.strategy.holds_whole_model:
                sample = s.recipe.on_train_end(s.raw_model, s.config, rt)
            elif rt.is_main_process:
                log.info("no sample: under pipeline parallelism no rank holds the whole model (export the checkpoint)")
        s.checkpointer.close()  # an async save in flight is committed, and durable, before we return
        if s.writer:
            s.writer.close("stopped" if preempted else "finished")
        # The raw model, not the DDP wrapper: a wrapper kept past teardown can hang the exit (see dist.teardown).
        exit_code = PreemptionWatch.exit_code(stop) if preempted else 0
        return TrainResult(
            state.step, self.train_loss, self.val_loss, initial_val_loss, self.checkpoint, sample, s.raw_model,
            preempted, exit_code,
        )  # fmt: skip


def _plain(value: bool | torch.Tensor) -> torch.Tensor:
    """A number of the step as a plain tensor (a DTensor's whole value; a bool as a CPU tensor)."""
    if is_dtensor(value):
        return value.full_tensor()
    return value.detach().reshape(()) if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def _stop_reason(stop: int) -> str:
    return "Ctrl-C" if stop == 2 else "preemption requested (SIGTERM)"


class NonFiniteError(UserError, RuntimeError):
    """A NaN/inf gradient with train.nonfinite=abort, or too many skipped steps in a row."""

    def __init__(self, message: str, reduce: PendingReduce | None = None) -> None:
        super().__init__(message)
        self.reduce = reduce
        """The failing step's all-reduce, which carried the window closed at the step before, if one was (the loop
        completes it)."""


def _nonfinite(s: Session, step: int, step_loss: torch.Tensor, reduced: PendingReduce) -> bool:
    """Every rank arrives here together (see the caller). Raises for nonfinite=abort; False otherwise."""
    rt = s.runtime
    sick = [r for r, bad in enumerate(rt.all_gather_object(not math.isfinite(float(step_loss)))) if bad]
    where = f"the loss was non-finite on rank(s) {sick}" if sick else "the losses were finite: the gradients overflowed"
    if s.config.train.nonfinite == "abort":
        raise NonFiniteError(
            f"non-finite gradient norm at step {step} ({where}); the optimizer step was not taken. "
            "Fix: lower optim.lr, check the data, or --train.nonfinite=skip to skip such steps.",
            reduced,
        )
    if rt.is_main_process:
        log.warning("step %d skipped on every rank: non-finite gradient norm (%s)", step, where)
    return False


def _validate(s: Session) -> float:
    """The validation loss now (collective); rank 0 writes it and the recipe's other metrics as a "val" record."""
    val_loss, val_extra = _evaluate(s.model, s.val_set, s.eval_ids, s.recipe, s.runtime)
    if s.writer:
        s.writer.write(s.state.step, {"val_loss": val_loss, **val_extra}, kind="val")
    return val_loss


@torch.no_grad()
def _evaluate(
    model: nn.Module, val_set: Dataset[Any], micro_batches: list[list[int]], recipe: Recipe, runtime: Runtime
) -> tuple[float, dict[str, float]]:
    """Mean validation loss over a fixed slice, weighted by targets across all ranks, and the recipe's
    other metrics (`Recipe.output_sums`, e.g. {"val_top1": accuracy}) as means over the same targets.
    Only the rank that owns a replica's loss (Strategy.owns_loss) adds its sums and targets."""
    model.eval()
    objective = recipe.objective()
    names = ("loss", *recipe.eval_metrics)  # declared up front: a rank may have no batches at all
    totals = torch.zeros(len(names) + 1, dtype=torch.float64, device=runtime.device)  # (*sums, targets)
    for ids in micro_batches:
        batch = default_collate([val_set[i] for i in ids or [0]])  # []: a throwaway forward (padding)
        sums = runtime.strategy.evaluate(model, runtime.to_device(batch), objective, runtime.precision)
        if ids and sums is not None:
            totals[-1] += recipe.count_targets(batch)
            for i, name in enumerate(names):
                totals[i] += sums[name].double()
    model.train()
    *reduced, targets = runtime.all_reduce(totals, "sum").tolist()  # one all-reduce for every metric
    loss, *extra = (float(r / targets) for r in reduced)
    return loss, {f"val_{name}": value for name, value in zip(recipe.eval_metrics, extra, strict=True)}
