"""`Runtime`: the one object a training loop talks to — the public library API of trainmesh.

    rt = Runtime(precision="bf16-mixed")           # reads RANK/WORLD_SIZE/..., joins the group (or adopts
                                                    # one set up already, e.g. by Ray Train)
                                                    # (trainmesh's worker: job.runtime(), see job/spec.py)
    model, optimizer = rt.setup(model, optimizer)   # device placement + DDP (or single, dp); optimizer.step()
                                                    # is rt.step(optimizer) from now on (runtime/optimizer.py)
    loader = rt.setup_dataloader(loader)            # each rank reads its own shard
    with rt.no_sync(model, enabled=not last_micro_step), rt.autocast():
        loss = ...
    rt.backward(loss)
    rt.clip_grad_norm(model, optimizer, 1.0); rt.step(optimizer)

It is passed explicitly (no global singleton) and owns the device, the Strategy and the Precision; engine code
asks `rt.strategy` and `rt.precision` directly. Its collectives are `Collectives`' (runtime/collectives.py).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import replace
from typing import Any, TypeVar, cast, overload

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from trainmesh.config.schema import DistConfig, Float8Config, ParallelConfig
from trainmesh.core.dist import (
    current_env,
    group_backend,
    init_process_group,
    seed_everything,
    select_backend,
    select_device,
    set_deterministic,
    set_tf32,
    teardown,
    tf32_note,
)
from trainmesh.core.env import DistEnv
from trainmesh.core.logging import configure_logging
from trainmesh.data.workers import worker_init
from trainmesh.precision import Precision, build_precision
from trainmesh.runtime.collectives import Collectives, PendingReduce
from trainmesh.runtime.optimizer import RuntimeOptimizer, guard_optimizer, unwrap_optimizer
from trainmesh.strategies import Layout, ParallelPlan, Strategy, build_strategy, check_layout, resolve_parallelism

__all__ = ["PendingReduce", "Runtime"]  # PendingReduce: also importable from here, where train/ reads it

T = TypeVar("T")


class Runtime(Collectives):
    """Keyword-only; every argument has a default. `strategy` is short for `parallel.strategy`: the
    `[parallel]` section (its degrees, ddp/fsdp/pipeline options) and `dist_config`, the `[dist]` section
    (device, backend, timeouts), are the config's own dataclasses (trainmesh.config.schema). `layout`: a Job's
    (`job.runtime()`: resolved and checked for this world size by `resolve`); None: resolved and checked here.
    `float8`: the [float8] section's options of precision="fp8-mixed". `dist`: dist_config's old name, for one
    release."""

    def __init__(
        self,
        *,
        strategy: str | None = None,
        precision: str = "32-true",
        float8: Float8Config | None = None,
        parallel: ParallelConfig | None = None,
        dist_config: DistConfig | None = None,
        compile: bool = False,
        seed: int | None = None,
        deterministic: bool = False,
        tf32: bool | None = None,
        env: DistEnv | None = None,
        layout: Layout | None = None,
        dist: DistConfig | None = None,
    ) -> None:
        parallel = parallel or ParallelConfig()
        if strategy is not None:
            parallel = replace(parallel, strategy=strategy)
        dist_config = _renamed_dist(dist_config, dist)
        env = env or current_env()  # a process group that exists already (Ray Train's) says who we are
        self.log = configure_logging(env.rank, env.world_size)
        if layout is None:  # the library's own path; a Job's layout was checked when the job was resolved
            layout = resolve_parallelism(parallel, env.world_size)
            check_layout(parallel, layout, precision, float8)
        assert layout.dims.world_size == env.world_size, f"{layout} resolved for another world size"
        super().__init__(env, select_device(dist_config.device, env), dist_config.timeout_s)
        if torch.distributed.is_initialized():  # adopted as it is: its backend must be what was asked for
            self.backend = group_backend(dist_config.backend, self.device)
        else:
            self.backend = select_backend(dist_config.backend, self.device)
        self.precision: Precision = build_precision(precision, self.device, float8)
        self.owns_group = init_process_group(
            env,
            self.backend,
            self.device,
            dist_config.timeout_s,
            required=layout.needs_process_group,
            init_timeout_s=dist_config.init_timeout_s,
            debug=dist_config.debug,
        )
        """Whether this Runtime created the process group (and destroys it in `teardown`); an adopted one is
        left to whoever set it up (Ray Train destroys its own when the workers stop)."""
        self.strategy: Strategy = build_strategy(
            layout,
            env=env,
            device=self.device,
            parallel=parallel,
            compile=compile,
            gather_dtype=self.precision.gather_dtype,
        )
        set_deterministic(deterministic)
        if tf32 is not None:  # None: leave the process's setting as it is
            set_tf32(self.device, tf32)
        self.tf32 = self.device.type == "cuda" and torch.get_float32_matmul_precision() != "highest"
        """Whether float32 matmuls run on TF32 tensor cores here (it sets the MFU peak)."""
        note = tf32_note(self.device)
        if note:
            self.log.info(note)
        if seed is not None:
            seed_everything(seed)

    # -- model and data ----------------------------------------------------------------------------
    @overload
    def setup(self, model: nn.Module, *, plan: ParallelPlan | None = None) -> nn.Module: ...

    @overload
    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, *, plan: ParallelPlan | None = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]: ...

    def setup(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        plan: ParallelPlan | None = None,
    ) -> nn.Module | tuple[nn.Module, torch.optim.Optimizer]:
        """Cast for the precision, place and wrap for the strategy. `plan`: the model's blocks
        (checkpointed and sharded one by one, compiled one by one where sharded; default: the modules in its
        nn.ModuleLists) and
        its tensor-parallel and pipeline plans (strategies/plan.py).

        Parameters are moved in place, so an optimizer built before or after `setup` both work, except
        with fsdp, tensor or pipeline parallelism, which replace them by shards or keep only a stage:
        build the optimizer from the returned module's parameters there, and pass it to `setup_optimizer`.
        The optimizer returned is `setup_optimizer(optimizer)`'s.
        """
        if optimizer is not None and self.strategy.collective_forward:
            raise ValueError(
                f"parallel.strategy={self.strategy.name!r} (with fsdp, tp or pp) replaces the parameters by "
                "shards or keeps only some of them, so an optimizer built before setup() would update stale "
                "tensors. Fix: model = rt.setup(model), then build the optimizer from model.parameters() and pass "
                "it to rt.setup_optimizer(optimizer)."
            )
        # The precision converts the whole model first (fp8-mixed swaps its linear layers), then the strategy
        # shards, splits, checkpoints and compiles what it converted.
        wrapped = self.strategy.setup_module(self.precision.convert_module(model), plan)
        self.precision.attach(wrapped)
        return wrapped if optimizer is None else (wrapped, self.setup_optimizer(optimizer))

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer whose `step()` is `rt.step(optimizer)` (a plain step would apply 16-mixed's overflowing
        gradients), otherwise `optimizer` itself: its state, param groups, LR schedulers and checkpoints. Whether
        a step was skipped: `rt.step`'s bool, or its `step_was_skipped`. See runtime/optimizer.py."""
        return guard_optimizer(optimizer, self.precision)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.strategy.unwrap(model)

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas: how many ways your own data is split (tensor and pipeline peers share one)."""
        return self.strategy.dp_size

    @property
    def dp_rank(self) -> int:
        """This process's data-parallel replica, 0 to dp_size - 1: which share of your data it reads."""
        return self.strategy.dp_rank

    def setup_dataloader(self, loader: DataLoader[Any], seed: int = 0) -> DataLoader[Any]:
        """Rebuild `loader` so each data-parallel rank reads a disjoint shard (DistributedSampler).

        The sampler is a DistributedSampler at every scale (one process too), so the same loop runs
        unchanged: call `loader.sampler.set_epoch(epoch)` each epoch for a fresh shuffle. trainmesh's
        recipes use `trainmesh.data.sharding.GlobalBatchSampler`, whose order is world-size independent.
        """
        if loader.batch_size is None:
            raise ValueError("setup_dataloader needs a DataLoader with batch_size, not a custom batch_sampler")
        sampler: DistributedSampler[Any] = DistributedSampler(
            loader.dataset,
            num_replicas=self.strategy.dp_size,
            rank=self.strategy.dp_rank,
            shuffle=isinstance(loader.sampler, RandomSampler),
            seed=seed,
            drop_last=loader.drop_last,
        )
        return DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            sampler=sampler,
            num_workers=loader.num_workers,
            collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory,
            drop_last=loader.drop_last,
            worker_init_fn=worker_init(loader.worker_init_fn),  # workers leave SIGTERM/SIGINT to the rank
            persistent_workers=loader.persistent_workers,
        )

    def to_device(self, batch: T) -> T:
        """Move every tensor in a (nested) tuple/list/dict batch to this rank's device."""
        moved: Any = batch
        if isinstance(batch, torch.Tensor):
            moved = batch.to(self.device, non_blocking=True)
        elif isinstance(batch, (list, tuple)):
            moved = type(batch)(self.to_device(b) for b in batch)
        elif isinstance(batch, dict):
            moved = {k: self.to_device(v) for k, v in batch.items()}
        return cast(T, moved)

    def data_parallel_group(self) -> torch.distributed.ProcessGroup | None:
        """The group of this rank's data-parallel replicas (e.g. for SyncBatchNorm); None: the whole
        world when there is no model parallelism, or no group at all. Collective: every rank calls it."""
        mesh = self.strategy.mesh
        if mesh is None or mesh.dims.dp_size == self.world_size:
            return None
        return mesh.dp_group()

    # -- one training step -------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return self.precision.autocast()

    def no_sync(self, model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no all-reduce) while `enabled`: wrap non-final micro-steps."""
        return self.strategy.no_sync(model, enabled)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def clip_grad_norm(self, model: nn.Module, optimizer: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
        """Unscale (fp16), then clip the global gradient norm; returns the norm before clipping."""
        self.precision.unscale(unwrap_optimizer(optimizer))
        return self.strategy.clip_grad_norm(model, max_norm)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Optimizer step; False when skipped for a loss-scale overflow (the same on every rank)."""
        if isinstance(optimizer, RuntimeOptimizer):  # through its own step, which an LR scheduler may count
            optimizer.step()
            return not optimizer.step_was_skipped
        return self.precision.step(optimizer)

    # -- checkpoints of your own loop -----------------------------------------------------------------
    def state_dicts(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state keyed by parameter name, free of wrapper prefixes (DCP-ready)."""
        return self.strategy.state_dicts(model, unwrap_optimizer(optimizer))

    def load_state_dicts(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
    ) -> None:
        self.strategy.load_state_dicts(model, unwrap_optimizer(optimizer), model_state, optim_state)

    def precision_state(self) -> dict[str, Any]:
        """The precision's state for a checkpoint (the fp16 loss scale)."""
        return self.precision.state_dict()

    def load_precision_state(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state)

    # -- output and lifecycle ----------------------------------------------------------------------
    def print(self, *args: object, level: int = logging.INFO) -> None:
        """Log a message once (rank 0), like print."""
        self.log.log(level, " ".join(str(a) for a in args))

    def teardown(self, success: bool = True) -> None:
        """Leave the process group: destroy it when this Runtime created it (core.dist.teardown)."""
        if self.owns_group:
            teardown(success)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.teardown(success=exc_type is None)


def _renamed_dist(dist_config: DistConfig | None, dist: DistConfig | None) -> DistConfig:
    """The [dist] section given as `dist_config=`, or as `dist=` (its old name, which hid torch.distributed)."""
    if dist is None:
        return dist_config or DistConfig()
    if dist_config is not None:
        raise TypeError("Runtime() got both dist_config= and dist= (its old name). Fix: pass dist_config= only.")
    warnings.warn(
        "Runtime(dist=...) is deprecated and will be removed in the next release. Fix: Runtime(dist_config=...), "
        "the same DistConfig.",
        DeprecationWarning,
        stacklevel=3,
    )
    return dist
