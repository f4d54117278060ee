"""The training loop. One optimizer step (`train_step`) is:

    1. read this rank's `accum_steps` micro-batches of the global batch (data/sharding.py)
    2. all-reduce how many targets the whole global batch holds (the loss's true denominator), together with
       the previous step's loss for the log (train/window.py) and any stop request
    3. forward + backward each micro-batch; only the last one synchronises gradients (no_sync; a
       pipeline synchronises its stages' gradients at the end of each pass of its schedule)
    4. unscale (fp16), clip the global gradient norm, step (skipped together on overflow), zero grads

and around it `train` logs every `run.log_every` steps (train/window.py), evaluates and checkpoints on
schedule, and stops with a checkpoint when a rank receives SIGTERM or Ctrl-C. Setting up the model, data
and optimizer is train/setup.py; what watches the run from outside (signals, stall watchdog, test faults)
is one `RunHooks` object (train/hooks.py).

Everything strategy- or precision-specific happens behind `runtime` (the two seams), so this file has
no branch on either.
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
from trainmesh.config.schema import Config, TrainConfig
from trainmesh.core.batch import BatchPlan, loss_scale
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger
from trainmesh.data.workers import Batches
from trainmesh.metrics.breakdown import describe
from trainmesh.metrics.monitor import Monitor
from trainmesh.metrics.profiler import StepProfiler
from trainmesh.metrics.progress import ProgressBar
from trainmesh.recipes.base import Recipe
from trainmesh.runtime.runtime import PendingReduce, Runtime
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
    """This rank's loss summed over its micro-batches (on the device: no host synchronisation)."""
    targets: float
    """Targets in the whole global batch."""
    grad_norm: torch.Tensor
    stepped: bool
    """False when the step was skipped (fp16 overflow, or a non-finite gradient with nonfinite=skip)."""
    stop_votes: float
    """Ranks that received SIGTERM or Ctrl-C before this step."""
    reduce: PendingReduce
    """The step's all-reduce, which also carried the loss of the steps before it (for the metrics window)."""


def train(
    config: Config, plan: BatchPlan, recipe: Recipe, runtime: Runtime, run_dir: Path, hooks: RunHooks | None = None
) -> TrainResult:
    """Train to `train.max_steps` with the batch `plan` (a resolved Job's), or until a rank receives SIGTERM or
    Ctrl-C (then: checkpoint and stop). The [profile] section's traces record the steps it schedules; its
    out-of-memory snapshot covers everything from the model's construction on."""
    hooks = hooks or RunHooks()
    with StepProfiler(config.profile, run_dir, runtime.rank, runtime.device) as profiler:
        session = set_up(config, plan, recipe, runtime, run_dir, hooks.faults)
        hooks.started(session.start_step)
        try:
            with Monitor(runtime.device) as monitor:  # host and device figures for the metrics, off this thread
                window = MetricsWindow(plan, runtime, session.flops_per_token, session.peak, profiler.clock, monitor)
                return _run(config, plan, recipe, runtime, session, hooks, profiler, window)
        except BaseException as e:  # the records so far are written, and a tracker shows the run as failed
            if session.writer:
                session.writer.close("failed" if isinstance(e, Exception) else "stopped")
            raise


def _run(
    config: Config,
    plan: BatchPlan,
    recipe: Recipe,
    runtime: Runtime,
    s: Session,
    hooks: RunHooks,
    profiler: StepProfiler,
    window: MetricsWindow,
) -> TrainResult:
    tcfg, ckpt, state = config.train, config.checkpoint, s.state

    def evaluate() -> float:
        val_loss, val_extra = _evaluate(s.model, s.val_set, s.eval_ids, recipe, runtime)
        if s.writer:
            s.writer.write(state.step, {"val_loss": val_loss, **val_extra}, kind="val")
        return val_loss

    initial_val_loss = val_loss = evaluate() if state.step == 0 else math.nan
    if runtime.is_main_process and state.step == 0:
        log.info("step 0: val loss %.4f", initial_val_loss)
    progress = ProgressBar(tcfg.max_steps, state.step, enabled=runtime.is_main_process and config.run.progress)
    batches = Batches(s.loader)
    train_loss, skipped_in_a_row = math.nan, 0
    checkpoint: Path | None = None
    stop = 0  # the stop signal the ranks agreed on (PreemptionWatch.vote)

    def report(record: Record | None) -> None:
        nonlocal train_loss
        if record is not None:
            train_loss = record.metrics["loss"]
            if s.writer:
                s.writer.write(record.step, record.metrics)
            progress.update(record.step, train_loss, record.metrics["lr"], record.metrics.get("tokens_per_s"))

    def save() -> Path:
        report(window.flush())  # the records up to a checkpoint are written before it: a resume continues after
        profiler.mark("checkpoint")
        path = s.save(runtime)
        profiler.mark("other")
        return path

    window.start = time.perf_counter()  # the initial evaluation and the loader's start are no step's time
    try:
        for step in range(state.step, tcfg.max_steps):
            lr = lr_at(step, config.optim, tcfg.max_steps)
            set_lr(s.optimizer, lr)
            try:
                result = train_step(step + 1, s, batches, plan, recipe, runtime, hooks, profiler, tcfg, window.carry())
                skipped_in_a_row = 0 if result.stepped else skipped_in_a_row + 1
                if skipped_in_a_row > tcfg.max_skipped_steps:
                    raise NonFiniteError(
                        f"{skipped_in_a_row} steps in a row were skipped (non-finite gradients), last: {step + 1}",
                        result.reduce,
                    )
            except NonFiniteError as e:  # every rank decided the same: the records of the steps before are kept
                report(window.abort(e.reduce))
                raise
            if not result.stepped:
                runtime.on_skipped_step()  # e.g. PowerSGD's error feedback took in the non-finite gradient
            state.step = step + 1
            state.samples_seen += plan.global_batch
            hooks.after_step(state.step)
            with profiler.phase("log"):
                report(window.add(result.reduce, result.loss, result.targets, result.stepped))  # the previous window's
                if state.step % config.run.log_every == 0 or state.step == tcfg.max_steps or result.stop_votes:
                    window.close(state.step, lr, result.grad_norm)
            profiler.step()

            pause_start = time.perf_counter()  # evaluation and checkpoints are not training-step time
            if tcfg.eval_every and state.step % tcfg.eval_every == 0 and state.step < tcfg.max_steps:
                profiler.mark("eval")
                val_loss = evaluate()
                profiler.mark("other")
                progress.message(f"step {state.step}: val loss {val_loss:.4f}")
            if ckpt.every and state.step % ckpt.every == 0 and state.step < tcfg.max_steps:
                checkpoint = save()
            hooks.progress(state.step)
            window.pause(time.perf_counter() - pause_start)
            if result.stop_votes:  # SIGTERM or Ctrl-C reached some rank; every rank learns it at this same step
                stop = int(runtime.all_reduce(float(hooks.stop_vote), "max"))  # which one; Ctrl-C wins
                progress.message(f"{_stop_reason(stop)}: stopping at step {state.step} with a checkpoint")
                if checkpoint != step_dir(s.checkpointer.run_dir, state.step):
                    checkpoint = save()
                break
    finally:
        batches.close()  # its worker processes go now, however the loop ended (data/workers.py)

    report(window.flush())  # the last window: its final step's loss, which no further step carries
    progress.close()
    if runtime.is_main_process:
        log.info("where the steps' time went on rank 0: %s", describe(window.run_totals_s))
    preempted = state.step < tcfg.max_steps
    sample = ""
    if not preempted:
        val_loss = evaluate()
        if ckpt.final and state.step > s.start_step:  # the same decision on every rank
            checkpoint = save()
        hooks.progress(state.step)  # the final evaluation and save were progress too
        # The raw module shares the trained parameters and sits outside any DDP wrapper. Every rank runs
        # it (a sharded model's forward is collective); rank 0's result is the one reported.
        if runtime.holds_whole_model:
            sample = recipe.on_train_end(s.raw_model, config, runtime)
        elif runtime.is_main_process:
            log.info("no sample: under pipeline parallelism no rank holds the whole model (export the checkpoint)")
    s.checkpointer.close()  # an async save in flight is committed, and durable, before we return
    if s.writer:
        s.writer.close("stopped" if preempted else "finished")
    # The raw model, not the DDP wrapper: a wrapper kept past teardown can hang the exit (see dist.teardown).
    exit_code = PreemptionWatch.exit_code(stop) if preempted else 0
    return TrainResult(
        state.step, train_loss, val_loss, initial_val_loss, checkpoint, sample, s.raw_model, preempted, exit_code
    )


def train_step(
    step: int,
    s: Session,
    batches: Iterator[Any],
    plan: BatchPlan,
    recipe: Recipe,
    runtime: Runtime,
    hooks: RunHooks,
    profiler: StepProfiler,
    tcfg: TrainConfig,
    carry: torch.Tensor,
) -> StepResult:
    """Optimizer step `step` (counted from 1): steps 1-4 of the module docstring. `carry`: this rank's loss of
    earlier steps, for the metrics window, reduced in the step's all-reduce."""
    probe = hooks.probe  # the parity check's (None in every other run)
    if probe is not None:  # its collectives before the step's own
        probe.before_step(runtime, s.raw_model)
    profiler.mark("data")
    with profiler.phase("data"):
        hooks.before_data(step)
        micro_batches = [next(batches) for _ in range(plan.accum_steps)]
    # Counted on the CPU, once per model replica (pipeline and tensor-parallel peers read the same batch).
    local_targets = sum(recipe.count_targets(mb) for mb in micro_batches) if runtime.owns_loss else 0
    # In flight during the first forward: the batch's target count, how many ranks saw SIGTERM, the earlier loss.
    reduced = runtime.all_reduce_async([local_targets, float(hooks.stop_requested)], "sum", carry)
    objective = replace(s.objective, loss=hooks.loss(s.objective.loss, step))

    def scale() -> float:  # the first call waits for the count: for the slowest peer's data, say
        profiler.mark("sync")
        count = reduced.result()[0]
        profiler.mark("forward")
        return loss_scale(count, runtime.dp_size)

    step_loss = torch.zeros((), dtype=torch.float64, device=runtime.device)  # this rank's summed loss
    with profiler.phase("forward_backward"):
        for i, batch in enumerate(micro_batches):
            profiler.mark("forward")  # and "backward", marked by the strategy between the two
            with runtime.no_sync(s.model, enabled=i < plan.accum_steps - 1):
                step_loss += runtime.forward_backward(
                    s.model, runtime.to_device(batch), objective, scale, profiler.mark
                )

    profiler.mark("optimizer")
    with profiler.phase("optimizer"):
        grad_norm = runtime.clip_grad_norm(s.model, s.optimizer, tcfg.grad_clip)
        if probe is not None:  # every strategy has synchronised the gradients by now
            probe.gradients(step, runtime, s.raw_model, grad_norm, tcfg.grad_clip)
        # The norm of the synchronised gradients is the same on every rank, and so is every decision here.
        if math.isfinite(float(grad_norm)) or runtime.scales_loss:
            stepped = runtime.step(s.optimizer)  # a GradScaler skips an overflowing step and lowers its scale
        else:
            stepped = _nonfinite(step, step_loss, tcfg, runtime, reduced)  # abort raises; skip returns False
        s.optimizer.zero_grad(set_to_none=True)
    profiler.mark("other")
    global_targets, stop_votes = reduced.result()
    if probe is not None:
        probe.after_step(step, runtime, s.raw_model, step_loss, global_targets, stepped)
    return StepResult(step_loss, global_targets, grad_norm, stepped, stop_votes, reduced)


def _stop_reason(stop: int) -> str:
    return "Ctrl-C" if stop == 2 else "preemption requested (SIGTERM)"


class NonFiniteError(UserError, RuntimeError):
    """A NaN/inf gradient with train.nonfinite=abort, or too many skipped steps in a row."""

    def __init__(self, message: str, reduce: PendingReduce | None = None) -> None:
        super().__init__(message)
        self.reduce = reduce
        """The failing step's all-reduce, which carried the last window's loss (the loop completes it)."""


def _nonfinite(step: int, step_loss: torch.Tensor, tcfg: TrainConfig, runtime: Runtime, reduced: PendingReduce) -> bool:
    """Every rank arrives here together (see the caller). Raises for nonfinite=abort; False otherwise."""
    sick = [r for r, bad in enumerate(runtime.all_gather_object(not math.isfinite(float(step_loss)))) if bad]
    where = f"the loss was non-finite on rank(s) {sick}" if sick else "the losses were finite: the gradients overflowed"
    if tcfg.nonfinite == "abort":
        raise NonFiniteError(
            f"non-finite gradient norm at step {step} ({where}); the optimizer step was not taken. "
            "Fix: lower optim.lr, check the data, or --train.nonfinite=skip to skip such steps.",
            reduced,
        )
    if runtime.is_main_process:
        log.warning("step %d skipped on every rank: non-finite gradient norm (%s)", step, where)
    return False


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
        sums = runtime.evaluate(model, runtime.to_device(batch), objective)
        if ids and sums is not None:
            totals[-1] += recipe.count_targets(batch)
            for i, name in enumerate(names):
                totals[i] += sums[name].double()
    model.train()
    *reduced, targets = runtime.all_reduce(totals, "sum").tolist()  # one all-reduce for every metric
    loss, *extra = (float(r / targets) for r in reduced)
    return loss, {f"val_{name}": value for name, value in zip(recipe.eval_metrics, extra, strict=True)}
