"""`Runtime`: the one object a training loop talks to — the public library API of trainmesh.

    rt = Runtime(precision="bf16-mixed")           # reads RANK/WORLD_SIZE/..., joins the group (or adopts
                                                    # one set up already, e.g. by Ray Train)
                                                    # (trainmesh's worker: job.runtime(), see job/resolve.py)
    model, optimizer = rt.setup(model, optimizer)   # device placement + DDP (or single, dp); optimizer.step()
                                                    # is rt.step(optimizer) from now on (runtime/optimizer.py)
    loader = rt.setup_dataloader(loader)            # each rank reads its own shard
    with rt.no_sync(model, enabled=not last_micro_step), rt.autocast():
        loss = ...
    rt.backward(loss)
    rt.clip_grad_norm(model, optimizer, 1.0); rt.step(optimizer)

It is passed explicitly (no global singleton) and owns the device, the Strategy and the Precision.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Literal, TypeVar, cast, overload

import torch
import torch.distributed as dist
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
from trainmesh.core.errors import UserError
from trainmesh.core.logging import configure_logging
from trainmesh.data.workers import worker_init
from trainmesh.precision import Precision, build_precision
from trainmesh.runtime.optimizer import RuntimeOptimizer, guard_optimizer, unwrap_optimizer
from trainmesh.strategies import Layout, ParallelPlan, Strategy, build_strategy, check_layout, resolve_parallelism
from trainmesh.strategies.base import Objective

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class PendingReduce:
    """An all-reduce in flight; `result()` waits once and returns the reduced numbers, `carried()` the reduced
    values of the tensor that rode along (see `Runtime.all_reduce_async`)."""

    def __init__(
        self, tensor: torch.Tensor, work: Any, divisor: int, count: int, carry: torch.Tensor | None = None
    ) -> None:
        self._tensor, self._work, self._divisor, self._count = tensor, work, divisor, count
        self._carry = carry  # one rank: not reduced, read only when asked for (a device sync on a GPU)
        self._values: list[float] | None = None

    def result(self) -> list[float]:
        return self._reduced()[: self._count]

    def carried(self) -> list[float]:
        if self._carry is not None:
            return [v / self._divisor for v in self._carry.reshape(-1).tolist()]
        return self._reduced()[self._count :]

    def _reduced(self) -> list[float]:
        if self._values is None:
            if self._work is not None:
                self._work.wait()
            self._values = [float(v) / self._divisor for v in self._tensor.tolist()]
        return self._values


class Runtime:
    """Keyword-only; every argument has a default. `strategy` is short for `parallel.strategy`: the
    `[parallel]` section (its degrees, ddp/fsdp/pipeline options) and `[dist]` section (device, backend,
    timeouts) are the config's own dataclasses (trainmesh.config.schema). `layout`: the strategy and mesh
    degrees already resolved for this world size (the worker passes its Job's); None: resolved here. `float8`:
    the [float8] section's options of precision="fp8-mixed"."""

    def __init__(
        self,
        *,
        strategy: str | None = None,
        precision: str = "32-true",
        float8: Float8Config | None = None,
        parallel: ParallelConfig | None = None,
        dist: DistConfig | None = None,
        compile: bool = False,
        seed: int | None = None,
        deterministic: bool = False,
        tf32: bool | None = None,
        env: DistEnv | None = None,
        layout: Layout | None = None,
    ) -> None:
        # `dist` (the [dist] section) hides the torch.distributed module in here only: use dist_config below.
        parallel = parallel or ParallelConfig()
        if strategy is not None:
            parallel = replace(parallel, strategy=strategy)
        dist_config = dist or DistConfig()
        self.env = env or current_env()  # a process group that exists already (Ray Train's) says who we are
        self.log = configure_logging(self.env.rank, self.env.world_size)
        layout = layout or resolve_parallelism(parallel, self.env.world_size)
        assert layout.dims.world_size == self.env.world_size, f"{layout} resolved for another world size"
        check_layout(parallel, layout, precision, float8)
        self.device = select_device(dist_config.device, self.env)
        if torch.distributed.is_initialized():  # adopted as it is: its backend must be what was asked for
            self.backend = group_backend(dist_config.backend, self.device)
        else:
            self.backend = select_backend(dist_config.backend, self.device)
        self.precision: Precision = build_precision(precision, self.device, float8)
        self.owns_group = init_process_group(
            self.env,
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
            env=self.env,
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

    # -- who am I ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def dp_size(self) -> int:
        return self.strategy.dp_size

    @property
    def dp_rank(self) -> int:
        return self.strategy.dp_rank

    @property
    def owns_loss(self) -> bool:
        """Whether this rank reports its model replica's loss (one rank per replica; see Strategy)."""
        return self.strategy.owns_loss

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main

    @property
    def seed_rank(self) -> int:
        """Ranks with the same number draw the same random numbers (tensor-parallel peers; see Strategy)."""
        return self.strategy.seed_rank

    @property
    def holds_whole_model(self) -> bool:
        """Whether this rank runs the whole model's forward (not so for a pipeline stage)."""
        return self.strategy.holds_whole_model

    @property
    def devices(self) -> int:
        """Accelerators this job computes on, over all processes (for MFU: nn.DataParallel uses several)."""
        return self.world_size * self.strategy.devices_per_process

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.precision.compute_dtype

    @property
    def peak_dtype(self) -> torch.dtype:
        return self.precision.peak_dtype

    @property
    def scales_loss(self) -> bool:
        """Whether the precision scales the loss (16-mixed): it then skips overflowing steps itself."""
        return self.precision.scales_loss

    def precision_state(self) -> dict[str, Any]:
        """The precision's state for a checkpoint (the fp16 loss scale)."""
        return self.precision.state_dict()

    def load_precision_state(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state)

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

    def rank_state(self) -> dict[str, Any]:
        """This rank's own state for a checkpoint (Strategy.rank_state)."""
        return self.strategy.rank_state()

    def load_rank_state(self, saved: dict[str, Any]) -> None:
        self.strategy.load_rank_state(saved)

    def on_skipped_step(self) -> None:
        """The optimizer step was skipped (a non-finite gradient): state built from its gradients is dropped."""
        self.strategy.on_skipped_step()

    @property
    def _has_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()

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
            num_replicas=self.dp_size,
            rank=self.dp_rank,
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

    # -- one training step -------------------------------------------------------------------------
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        return self.precision.autocast()

    def no_sync(self, model: nn.Module, enabled: bool = True) -> contextlib.AbstractContextManager[None]:
        """Accumulate gradients locally (no all-reduce) while `enabled`: wrap non-final micro-steps."""
        return self.strategy.no_sync(model, enabled)

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss)

    def forward_backward(
        self,
        model: nn.Module,
        batch: Any,
        objective: Objective,
        scale: Callable[[], float],
        mark: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (see Strategy.forward_backward); `mark("backward")` is called
        where backward begins (the step-time breakdown)."""
        return self.strategy.forward_backward(model, batch, objective, scale, self.precision, mark)

    def evaluate(self, model: nn.Module, batch: Any, objective: Objective) -> dict[str, torch.Tensor] | None:
        """Validation sums of one batch on the rank that owns the loss, None elsewhere (collective)."""
        return self.strategy.evaluate(model, batch, objective, self.precision)

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

    # -- communication -----------------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor | float, op: ReduceOp = "mean") -> torch.Tensor:
        """Reduce a metric over all ranks (a copy; the input is untouched)."""
        tensor = torch.as_tensor(value, dtype=torch.float64 if self.device.type == "cpu" else torch.float32)
        tensor = tensor.detach().clone().to(self.device)
        if self._has_group and self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op])
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_reduce_async(
        self, values: list[float], op: ReduceOp = "sum", carry: torch.Tensor | None = None
    ) -> PendingReduce:
        """Start reducing numbers over all ranks; `.result()` waits for them (overlap it with compute). `carry`:
        a tensor of numbers (on this rank's device) reduced in the same collective, read by `.carried()`: values
        that would otherwise need a collective of their own (the loop's logged loss and step times)."""
        tensor = torch.tensor(values, dtype=torch.float64)
        if not (self._has_group and self.world_size > 1):  # nothing to reduce: no trip through the device,
            return PendingReduce(tensor, None, 1, len(values), carry)  # whose read-back would wait for the GPU
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        tensor = tensor.to(self.device, dtype)
        if carry is not None:
            tensor = torch.cat([tensor, carry.detach().reshape(-1).to(dtype)])
        work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)
        return PendingReduce(tensor, work, self.world_size if op == "mean" else 1, len(values))

    # `group`: another group of all ranks, e.g. one that a background thread uses while training runs.
    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        if self._has_group:
            dist.barrier(group)

    def all_gather_object(self, obj: T, group: dist.ProcessGroup | None = None) -> list[T]:
        """Every rank's `obj`, in rank order (picklable objects)."""
        if not self._has_group or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: T, src: int = 0, group: dist.ProcessGroup | None = None) -> T:
        if not self._has_group or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's data-parallel replicas (e.g. for SyncBatchNorm); None: the whole
        world when there is no model parallelism, or no group at all. Collective: every rank calls it."""
        mesh = self.strategy.mesh
        if mesh is None or mesh.dims.dp_size == self.world_size:
            return None
        return mesh.dp_group()

    def new_group(self) -> dist.ProcessGroup | None:
        """Collective: a second gloo group of all ranks (None without a process group)."""
        return dist.new_group(backend="gloo") if self._has_group else None

    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Let local rank 0 of each node run the block first (e.g. build a cache), then the others. If it
        fails there, every rank raises (the others without running the block): a rank left waiting would
        otherwise see only its peer's death, with a traceback of its own."""
        first = self.local_rank == 0
        if not first:
            self._raise_if_any_failed(None)
        try:
            yield
        except Exception as e:
            if not first:
                raise
            self._raise_if_any_failed(e)
        if first:
            self._raise_if_any_failed(None)

    def on_main(self, fn: Callable[[], T]) -> T | None:
        """Collective: `fn()` on rank 0 only (it writes a run file, say) and its result there, None elsewhere.
        If it raises, every rank raises, instead of the others waiting for rank 0 in the next collective."""
        result, error = None, None
        if self.is_main_process:
            try:
                result = fn()
            except Exception as e:
                error = e
        self._raise_if_any_failed(error)
        return result

    def agreed(self, fn: Callable[[], T]) -> T:
        """Collective: `fn()` on every rank; if it raises on any rank, every rank raises."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:
            error = e
        self._raise_if_any_failed(error)
        return cast(T, result)

    def _raise_if_any_failed(self, error: Exception | None) -> None:
        """Collective: raise `error`, or the first other rank's failure (a UserError stays one)."""
        reports = self.all_gather_object(None if error is None else (isinstance(error, UserError), str(error)))
        for rank, report in enumerate(reports):
            if report is None:
                continue
            if error is not None:
                raise error
            is_user_error, message = report
            raise UserError(message) if is_user_error else RuntimeError(f"rank {rank} failed: {message}")

    # -- output ------------------------------------------------------------------------------------
    def print(self, *args: object, level: int = logging.INFO) -> None:
        """Log a message once (rank 0), like print."""
        self.log.log(level, " ".join(str(a) for a in args))

    # -- lifecycle ---------------------------------------------------------------------------------
    def teardown(self, success: bool = True) -> None:
        """Leave the process group: destroy it when this Runtime created it (core.dist.teardown)."""
        if self.owns_group:
            teardown(success)

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self.teardown(success=exc_type is None)
