"""Everything before the first step: data, model, optimizer, the resume decision's checkpoint, the loader
and the run's output files, gathered with the run's constants into one `Session` the loop works with."""

from __future__ import annotations

import contextlib
from collections.abc import Sized
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from trainmesh.checkpoint import Checkpointer, TrainerState, find_resumable, load_checkpoint
from trainmesh.checkpoint.catalog import check_no_collision
from trainmesh.config.loader import config_to_dict
from trainmesh.config.schema import Config
from trainmesh.core.batch import BatchSplit
from trainmesh.core.dist import seed_everything
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger
from trainmesh.core.versions import versions
from trainmesh.data.sharding import DataPosition, GlobalBatchSampler, eval_micro_batches, position_at_step
from trainmesh.data.workers import worker_init
from trainmesh.metrics.mfu import Peak, device_peak
from trainmesh.metrics.profiler import StepProfiler
from trainmesh.metrics.sinks import MetricsWriter
from trainmesh.metrics.trackers import trackers
from trainmesh.recipes.base import Recipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies.base import Objective
from trainmesh.train.hooks import RunHooks, StepHooks
from trainmesh.train.optim import build_optimizer

log = get_logger(__name__)


@dataclass
class Session:
    """What one training run works with (built by `set_up`; `state` advances as it trains): the run's constants,
    then what set-up built from them."""

    config: Config
    split: BatchSplit
    """The resolved batch: micro-batches per step (`accum_steps`) and samples per step (`global_batch`)."""
    recipe: Recipe
    runtime: Runtime
    hooks: StepHooks
    profiler: StepProfiler
    """Trace ranges and the step-time breakdown's marks (metrics/profiler.py)."""
    model: nn.Module
    """This rank's model as the strategy wrapped it (DDP, FSDP units, pipeline stages)."""
    raw_model: nn.Module
    """The same parameters outside any wrapper: all of the model, its shards or its pipeline stages."""
    optimizer: torch.optim.Optimizer
    objective: Objective
    state: TrainerState
    """Step, data position and what describes the run; saved in every checkpoint."""
    start_step: int
    sampler: GlobalBatchSampler
    loader: DataLoader[Any]
    val_set: Dataset[Any]
    eval_ids: list[list[int]]
    """This rank's validation micro-batches (a fixed slice of the validation set)."""
    checkpointer: Checkpointer
    writer: MetricsWriter | None
    """Rank 0's metrics files; None on the other ranks."""
    flops_per_token: float
    peak: Peak | None

    def save(self) -> Path:
        """Checkpoint the current step (with the data position after it); returns its folder."""
        self.state.precision = self.runtime.precision_state()
        after = self.sampler.position_after(self.state.step - self.start_step)
        self.state.data_epoch, self.state.data_offset = after.epoch, after.offset
        return self.checkpointer.save(self.model, self.optimizer, self.state)


def set_up(
    config: Config,
    split: BatchSplit,
    recipe: Recipe,
    runtime: Runtime,
    run_dir: Path,
    hooks: RunHooks,
    profiler: StepProfiler,
) -> Session:
    """Build the run's session on this rank: `hooks` and `profiler` watch it (the loop calls them, never the
    other way round)."""
    if runtime.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
    train_set, val_set = recipe.prepare(config, runtime)
    n_train, n_val = len(cast(Sized, train_set)), len(cast(Sized, val_set))

    # Same seed on every rank for the initial weights (DDP also broadcasts rank 0's), then a
    # rank-specific stream so dropout masks differ across data-parallel replicas.
    seed_everything(config.run.seed)
    with torch.device("meta") if config.parallel.meta_init else contextlib.nullcontext():
        whole_model = recipe.build_model(config, runtime)  # on meta: shapes only, no storage until setup
    flops_per_token = recipe.flops_per_token(whole_model)
    n_params = sum(p.numel() for p in whole_model.parameters())
    model = runtime.setup(whole_model, plan=recipe.parallel_plan(whole_model))
    raw_model = runtime.unwrap(model)
    del whole_model  # under pipeline parallelism the other stages' layers can now be freed
    optimizer = build_optimizer(raw_model, config.optim, runtime.device)  # on what setup left on this rank
    seed_everything(config.run.seed + 1 + runtime.strategy.seed_rank)

    state, position = _start_state(config, split, n_train, model, optimizer, runtime, run_dir)
    sampler = GlobalBatchSampler(
        n_train, split, runtime.strategy.dp_rank, config.run.seed, config.data.shuffle, position
    )
    loader = DataLoader(
        train_set,
        batch_sampler=sampler,
        num_workers=config.data.num_workers,
        worker_init_fn=worker_init(),  # workers ignore SIGTERM/SIGINT: this process stops at a step boundary
        pin_memory=runtime.device.type == "cuda",
        # Its own generator: creating the iterator would otherwise draw from the global RNG, shifting
        # the dropout stream between a fresh run and a resumed one.
        generator=torch.Generator().manual_seed(config.run.seed + runtime.rank),
    )
    eval_ids = eval_micro_batches(
        n_val, config.train.eval_samples, split.micro_batch, runtime.strategy.dp_rank, runtime.strategy.dp_size
    )
    writer = runtime.on_main(lambda: _metrics_writer(config, run_dir, resumed=state.step > 0))  # rank 0's
    peak = device_peak(runtime.device, runtime.precision.peak_dtype, runtime.tf32)
    if runtime.is_main_process:
        log.info("%s; %d steps/epoch; %s parameters", split.describe(), sampler.steps_per_epoch, f"{n_params:,}")
        if peak:
            log.info("MFU: %s", peak.describe())

    objective = recipe.objective()
    if config.train.compile:  # the loss too: fused with its fp32 upcast, the logits' softmax is no longer a memory pass
        objective = replace(objective, loss=torch.compile(objective.loss))
    ckpt = config.checkpoint
    checkpointer = Checkpointer(
        run_dir, runtime, ckpt.keep_last, background=ckpt.async_save, at_phase=hooks.faults.inject
    )
    step_hooks = StepHooks(hooks, runtime, raw_model, config.train.grad_clip)
    return Session(
        config, split, recipe, runtime, step_hooks, profiler, model, raw_model, optimizer, objective, state,
        state.step, sampler, loader, val_set, eval_ids, checkpointer, writer, flops_per_token, peak,
    )  # fmt: skip


def _metrics_writer(config: Config, run_dir: Path, resumed: bool) -> MetricsWriter:
    """Rank 0's metrics sinks (log.sinks). A file that cannot be opened stops every rank (Runtime.on_main); a
    tracker starts in the background and costs a warning if it fails. A run resumed from a checkpoint continues
    its tracker runs; one from step 0 starts new ones."""
    run_id = config.run.id or run_dir.name
    started = trackers(config.log, run_dir, run_id, config_to_dict(config), resumed)
    return MetricsWriter(run_dir, tensorboard="tensorboard" in config.log.sinks, trackers=started)


def _start_state(
    config: Config,
    split: BatchSplit,
    n_train: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    runtime: Runtime,
    run_dir: Path,
) -> tuple[TrainerState, DataPosition]:
    """A fresh state, or the newest valid checkpoint's (loaded into model and optimizer) when resuming."""
    state = TrainerState(world_size=runtime.world_size, config=config_to_dict(config), versions=versions())
    ckpt = config.checkpoint
    resume_from = find_resumable(run_dir, runtime, ckpt.on_corrupt) if ckpt.resume else None
    position = DataPosition()
    if resume_from is not None:
        state = load_checkpoint(resume_from, model, optimizer, runtime)
        position = _resumed_position(state, split, n_train, runtime)
        # Position and scaler come from the checkpoint; what describes this run is today's.
        state = replace(state, world_size=runtime.world_size, config=config_to_dict(config), versions=versions())
    elif ckpt.resume and runtime.is_main_process:
        log.warning("checkpoint.resume: no valid checkpoint in %s; STARTING FROM STEP 0", run_dir / "checkpoints")
    check_no_collision(run_dir, state.step, runtime)  # before any step: no save of this run can meet an old one
    state.global_batch = split.global_batch
    return state, position


def _resumed_position(state: TrainerState, split: BatchSplit, n_train: int, runtime: Runtime) -> DataPosition:
    """Where the data continues after a resume: the position the checkpoint recorded, whatever the global
    batch is now, so that no sample is repeated or skipped."""
    if not state.global_batch:  # saved before positions were recorded: the step fixed it
        return position_at_step(state.step, split.global_batch, n_train)
    position = DataPosition(state.data_epoch, state.data_offset)
    if position.offset > n_train:
        raise DataPositionError(
            f"the checkpoint stopped at sample {position.offset:,} of epoch {position.epoch}, but this training set "
            f"has {n_train:,} samples: the data changed since it was saved. Fix: resume with the data.source it was "
            "trained on, or start a new run (--run-id) with this data."
        )
    if state.global_batch != split.global_batch and runtime.is_main_process:
        log.warning(
            "the checkpoint was trained with a global batch of %d samples per step, this run takes %d (%s). The data "
            "continues at sample %d of epoch %d's order: no sample is repeated or skipped; the learning-rate schedule "
            "continues by step. To keep the original batch: --train.global_batch=%d.",
            state.global_batch,
            split.global_batch,
            split.describe(),
            position.offset,
            position.epoch,
            state.global_batch,
        )
    return position


class DataPositionError(UserError, ValueError):
    """A checkpoint's data position does not fit this run's training set."""
