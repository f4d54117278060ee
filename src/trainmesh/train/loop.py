"""The training loop. One optimizer step is:

    1. read this rank's `accum_steps` micro-batches of the global batch (data/sharding.py)
    2. all-reduce how many targets the whole global batch holds (the loss's true denominator)
    3. forward + backward each micro-batch; only the last one synchronises gradients (no_sync; a
       pipeline synchronises its stages' gradients at the end of each pass of its schedule)
    4. unscale (fp16), clip the global gradient norm, step (skipped together on overflow), zero grads
    5. every `log_every` steps: average the loss over ranks, log; evaluate / checkpoint on schedule

Everything strategy- or precision-specific happens behind `runtime` (the two seams), so this file has
no branch on either.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sized
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.dataloader import default_collate

from trainmesh.checkpoint import Checkpointer, TrainerState, find_resumable, load_checkpoint, step_dir
from trainmesh.checkpoint.catalog import check_no_collision
from trainmesh.config.loader import config_to_dict
from trainmesh.config.schema import Config, TrainConfig
from trainmesh.data.sharding import DataPosition, GlobalBatchSampler, eval_micro_batches, position_at_step
from trainmesh.faults import maybe_inject, poison_loss
from trainmesh.metrics.mfu import Peak, device_peak, mfu
from trainmesh.metrics.profiler import StepProfiler
from trainmesh.metrics.progress import ProgressBar
from trainmesh.metrics.sinks import MetricsWriter
from trainmesh.recipes.base import Recipe
from trainmesh.runtime.dist import seed_everything
from trainmesh.runtime.errors import UserError
from trainmesh.runtime.logging import get_logger
from trainmesh.runtime.runtime import PendingReduce, Runtime
from trainmesh.train.batch import BatchPlan, loss_scale
from trainmesh.train.optim import build_optimizer, lr_at, set_lr
from trainmesh.train.preemption import PreemptionWatch
from trainmesh.train.watchdog import StallWatchdog
from trainmesh.versions import versions

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


def train(
    config: Config,
    recipe: Recipe,
    runtime: Runtime,
    run_dir: Path,
    preemption: PreemptionWatch | None = None,
    watchdog: StallWatchdog | None = None,
) -> TrainResult:
    """Train to `train.max_steps`, or until `preemption` reports SIGTERM or Ctrl-C (then: checkpoint and stop).
    Each finished step, evaluation and checkpoint is reported to `watchdog`. The [profile] section's
    traces record the steps it schedules; its out-of-memory snapshot covers everything from the model's
    construction on."""
    preemption = preemption or PreemptionWatch()  # not installed: never requested
    watchdog = watchdog or StallWatchdog.off()
    with StepProfiler(config.profile, run_dir, runtime.rank, runtime.device) as profiler:
        return _train(config, recipe, runtime, run_dir, preemption, watchdog, profiler)


def _train(
    config: Config,
    recipe: Recipe,
    runtime: Runtime,
    run_dir: Path,
    preemption: PreemptionWatch,
    watchdog: StallWatchdog,
    profiler: StepProfiler,
) -> TrainResult:
    tcfg = config.train
    if runtime.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    plan = BatchPlan.derive(tcfg, runtime.dp_size, recipe.tokens_per_sample(config.model))
    recipe.prepare(config, runtime)
    train_set, val_set = recipe.datasets()
    n_train, n_val = len(cast(Sized, train_set)), len(cast(Sized, val_set))

    # Same seed on every rank for the initial weights (DDP also broadcasts rank 0's), then a
    # rank-specific stream so dropout masks differ across data-parallel replicas.
    seed_everything(config.run.seed)
    with torch.device("meta") if config.parallel.meta_init else contextlib.nullcontext():
        whole_model = recipe.build_model(config)  # on meta: shapes only, no storage until setup
    flops_per_token = recipe.flops_per_token(whole_model)
    n_params = sum(p.numel() for p in whole_model.parameters())
    model = runtime.setup(whole_model, plan=recipe.parallel_plan(whole_model))
    # This rank's part of the model, outside any wrapper: all of it, its shards (fsdp, tp) or its
    # pipeline stages. The optimizer is built after setup, on what setup left here.
    raw_model = runtime.unwrap(model)
    del whole_model  # under pipeline parallelism the other stages' layers can now be freed
    optimizer = build_optimizer(raw_model, config.optim, runtime.device)
    seed_everything(config.run.seed + 1 + runtime.strategy.seed_rank)

    state = TrainerState(world_size=runtime.world_size, config=config_to_dict(config), versions=versions())
    ckpt = config.checkpoint
    resume_from = find_resumable(run_dir, runtime, ckpt.on_corrupt) if ckpt.resume else None
    position = DataPosition()
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, runtime)
        position = _resumed_position(state, plan, n_train, runtime)
        # Position and scaler come from the checkpoint; what describes this run is today's.
        state.world_size, state.config, state.versions = runtime.world_size, config_to_dict(config), versions()
    elif ckpt.resume and runtime.is_main_process:
        log.warning("checkpoint.resume: no valid checkpoint in %s; STARTING FROM STEP 0", run_dir / "checkpoints")
    check_no_collision(run_dir, state.step, runtime)  # before any step: no save of this run can meet an old one
    start_step, state.global_batch = state.step, plan.global_batch

    sampler = GlobalBatchSampler(n_train, plan, runtime.dp_rank, config.run.seed, config.data.shuffle, position)
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        num_workers=config.data.num_workers,
        pin_memory=runtime.device.type == "cuda",
        # Its own generator: creating the iterator would otherwise draw from the global RNG, shifting
        # the dropout stream between a fresh run and a resumed one.
        generator=torch.Generator().manual_seed(config.run.seed + runtime.rank),
    )
    eval_ids = eval_micro_batches(n_val, tcfg.eval_samples, plan.micro_batch, runtime.dp_rank, runtime.dp_size)
    writer = runtime.on_main(lambda: MetricsWriter(run_dir))  # rank 0's; a failure to open it stops every rank
    peak = device_peak(runtime.device, runtime.precision.compute_dtype, runtime.tf32)
    if runtime.is_main_process:
        log.info(
            "%s; %d steps/epoch; %s parameters",
            plan.describe(),
            sampler.steps_per_epoch,
            f"{n_params:,}",
        )
        if peak:
            log.info("MFU: %s", peak.describe())

    objective = recipe.objective()
    if tcfg.compile:  # the loss too: fused with its fp32 upcast, the logits' softmax is no longer a memory pass
        objective = replace(objective, loss=torch.compile(objective.loss))

    def evaluate() -> float:
        val_loss, val_extra = _evaluate(model, val_set, eval_ids, recipe, runtime)
        if writer:
            writer.write(state.step, {"val_loss": val_loss, **val_extra}, kind="val")
        return val_loss

    checkpointer = Checkpointer(run_dir, runtime, ckpt.keep_last, background=ckpt.async_save)

    def save() -> Path:
        state.precision = runtime.precision.state_dict()
        after = sampler.position_after(state.step - start_step)
        state.data_epoch, state.data_offset = after.epoch, after.offset
        return checkpointer.save(model, optimizer, state)

    initial_val_loss = val_loss = evaluate() if state.step == 0 else math.nan
    if runtime.is_main_process and state.step == 0:
        log.info("step 0: val loss %.4f", initial_val_loss)

    progress = ProgressBar(tcfg.max_steps, state.step, enabled=runtime.is_main_process and config.run.progress)
    data = iter(loader)
    window_loss = torch.zeros((), dtype=torch.float64, device=runtime.device)
    window_targets = 0.0
    window_start, window_steps, skipped, skipped_in_a_row = time.perf_counter(), 0, 0, 0
    train_loss = math.nan
    checkpoint: Path | None = None
    stop = 0  # the stop signal the ranks agreed on (PreemptionWatch.vote)

    for step in range(state.step, tcfg.max_steps):
        lr = lr_at(step, config.optim, tcfg.max_steps)
        set_lr(optimizer, lr)

        with profiler.phase("data"):
            maybe_inject(step + 1, "data", runtime.rank, run_dir)  # test hook: a stuck data loader
            micro_batches = [next(data) for _ in range(plan.accum_steps)]
        # Counted on the CPU, once per model replica (pipeline and tensor-parallel peers read the same batch).
        local_targets = sum(recipe.count_targets(mb) for mb in micro_batches) if runtime.owns_loss else 0
        # In flight during the first forward: the batch's target count, and how many ranks saw SIGTERM.
        reduced = runtime.all_reduce_async([local_targets, float(preemption.requested)], "sum")

        loss = poison_loss(objective.loss, step + 1, runtime.rank, run_dir)  # test hook, see faults.py
        step_objective = replace(objective, loss=loss)

        def scale(reduced: PendingReduce = reduced) -> float:  # bound to this step's count
            return loss_scale(reduced.result()[0], runtime.dp_size)

        step_loss = torch.zeros((), dtype=torch.float64, device=runtime.device)  # this rank's summed loss
        with profiler.phase("forward_backward"):
            for i, batch in enumerate(micro_batches):
                last = i == plan.accum_steps - 1
                with runtime.no_sync(model, enabled=not last):
                    step_loss += runtime.forward_backward(model, runtime.to_device(batch), step_objective, scale)

        with profiler.phase("optimizer"):
            grad_norm = runtime.clip_grad_norm(model, optimizer, tcfg.grad_clip)
            # The norm of the synchronised gradients is the same on every rank, and so is every decision here.
            if math.isfinite(float(grad_norm)) or runtime.precision.scales_loss:
                stepped = runtime.step(optimizer)  # a GradScaler skips an overflowing step and lowers its scale
            else:
                stepped = _nonfinite(step + 1, step_loss, tcfg, runtime)  # abort raises; skip returns False
            optimizer.zero_grad(set_to_none=True)
        skipped_in_a_row = 0 if stepped else skipped_in_a_row + 1
        skipped += not stepped
        if skipped_in_a_row > tcfg.max_skipped_steps:
            raise NonFiniteError(
                f"{skipped_in_a_row} steps in a row were skipped (non-finite gradients), last: {step + 1}"
            )

        state.step = step + 1
        state.samples_seen += plan.global_batch
        watchdog.beat(state.step)
        maybe_inject(state.step, "step", runtime.rank, run_dir)  # test hook; a no-op unless TRAINMESH_FAULT
        global_targets, stop_votes = reduced.result()
        if stepped:  # the logged loss is that of the steps taken
            window_loss += step_loss
            window_targets += global_targets
        window_steps += 1

        if state.step % config.run.log_every == 0 or state.step == tcfg.max_steps or stop_votes:
            with profiler.phase("log"):
                # The only per-window synchronisation: the loss summed over ranks / targets over ranks.
                window_sum = float(runtime.all_reduce(window_loss, "sum"))
                train_loss = window_sum / window_targets if window_targets else math.nan
                now = time.perf_counter()  # logging below is timed into the next window, like any step cost
                elapsed = now - window_start
                tokens_per_s = plan.tokens_per_step * window_steps / elapsed if plan.tokens_per_sample else None
                metrics = {
                    "loss": train_loss,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "step_time_ms": 1000 * elapsed / window_steps,
                    "samples_per_s": plan.global_batch * window_steps / elapsed,
                    "skipped_steps": skipped,
                }
                metrics.update(_throughput_metrics(tokens_per_s, flops_per_token, peak, runtime))
                if writer:
                    writer.write(state.step, metrics)
                progress.update(state.step, train_loss, lr, tokens_per_s)
                window_loss.zero_()
                window_targets, window_steps, window_start = 0.0, 0, now
        profiler.step()

        pause_start = time.perf_counter()  # evaluation and checkpoints are not training-step time
        if tcfg.eval_every and state.step % tcfg.eval_every == 0 and state.step < tcfg.max_steps:
            val_loss = evaluate()
            progress.message(f"step {state.step}: val loss {val_loss:.4f}")
        if ckpt.every and state.step % ckpt.every == 0 and state.step < tcfg.max_steps:
            checkpoint = save()
        watchdog.beat(state.step)
        window_start += time.perf_counter() - pause_start
        if stop_votes:  # SIGTERM or Ctrl-C reached some rank; every rank learns it at this same step
            stop = int(runtime.all_reduce(float(preemption.vote), "max"))  # which one; Ctrl-C wins
            progress.message(f"{_stop_reason(stop)}: stopping at step {state.step} with a checkpoint")
            if checkpoint != step_dir(run_dir, state.step):
                checkpoint = save()
            break

    progress.close()
    preempted = state.step < tcfg.max_steps
    sample = ""
    if not preempted:
        val_loss = evaluate()
        if ckpt.final and state.step > start_step:  # the same decision on every rank
            checkpoint = save()
        watchdog.beat(state.step)  # the final evaluation and save were progress too
        # The raw module shares the trained parameters and sits outside any DDP wrapper. Every rank runs
        # it (a sharded model's forward is collective); rank 0's result is the one reported.
        if runtime.strategy.holds_whole_model:
            sample = recipe.on_train_end(raw_model, config, runtime)
        elif runtime.is_main_process:
            log.info("no sample: under pipeline parallelism no rank holds the whole model (export the checkpoint)")
    checkpointer.close()  # an async save in flight is committed, and durable, before we return
    if writer:
        writer.close()
    # The raw model, not the DDP wrapper: a wrapper kept past teardown can hang the exit (see dist.teardown).
    exit_code = PreemptionWatch.exit_code(stop) if preempted else 0
    return TrainResult(
        state.step, train_loss, val_loss, initial_val_loss, checkpoint, sample, raw_model, preempted, exit_code
    )


def _stop_reason(stop: int) -> str:
    return "Ctrl-C" if stop == 2 else "preemption requested (SIGTERM)"


def _resumed_position(state: TrainerState, plan: BatchPlan, n_train: int, runtime: Runtime) -> DataPosition:
    """Where the data continues after a resume: the position the checkpoint recorded, whatever the global
    batch is now, so that no sample is repeated or skipped."""
    if not state.global_batch:  # saved before positions were recorded: the step fixed it
        return position_at_step(state.step, plan.global_batch, n_train)
    position = DataPosition(state.data_epoch, state.data_offset)
    if position.offset > n_train:
        raise DataPositionError(
            f"the checkpoint stopped at sample {position.offset:,} of epoch {position.epoch}, but this training set "
            f"has {n_train:,} samples: the data changed since it was saved. Fix: resume with the data.source it was "
            "trained on, or start a new run (--run-id) with this data."
        )
    if state.global_batch != plan.global_batch and runtime.is_main_process:
        log.warning(
            "the checkpoint was trained with a global batch of %d samples per step, this run takes %d (%s). The data "
            "continues at sample %d of epoch %d's order: no sample is repeated or skipped; the learning-rate schedule "
            "continues by step. To keep the original batch: --train.global_batch=%d.",
            state.global_batch,
            plan.global_batch,
            plan.describe(),
            position.offset,
            position.epoch,
            state.global_batch,
        )
    return position


class DataPositionError(UserError, ValueError):
    """A checkpoint's data position does not fit this run's training set."""


class NonFiniteError(UserError, RuntimeError):
    """A NaN/inf gradient with train.nonfinite=abort, or too many skipped steps in a row."""


def _nonfinite(step: int, step_loss: torch.Tensor, tcfg: TrainConfig, runtime: Runtime) -> bool:
    """Every rank arrives here together (see the caller). Raises for nonfinite=abort; False otherwise."""
    sick = [r for r, bad in enumerate(runtime.all_gather_object(not math.isfinite(float(step_loss)))) if bad]
    where = f"the loss was non-finite on rank(s) {sick}" if sick else "the losses were finite: the gradients overflowed"
    if tcfg.nonfinite == "abort":
        raise NonFiniteError(
            f"non-finite gradient norm at step {step} ({where}); the optimizer step was not taken. "
            "Fix: lower optim.lr, check the data, or --train.nonfinite=skip to skip such steps."
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
    loss, *extra = (float(s / targets) for s in reduced)
    return loss, {f"val_{name}": value for name, value in zip(recipe.eval_metrics, extra, strict=True)}


def _throughput_metrics(
    tokens_per_s: float | None, flops_per_token: float, peak: Peak | None, runtime: Runtime
) -> dict[str, float]:
    out: dict[str, float] = {}
    if tokens_per_s is not None:
        out["tokens_per_s"] = tokens_per_s
        devices = runtime.world_size * runtime.strategy.devices_per_process
        value = mfu(flops_per_token, tokens_per_s / devices, peak)
        if value is not None:
            out["mfu"] = value
    if runtime.device.type == "cuda":
        out["peak_mem_gb"] = torch.cuda.max_memory_allocated(runtime.device) / 2**30
    return out
