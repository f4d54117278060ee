"""Strategies, chosen by name (`parallel.strategy`) and composed with the model-parallel degrees
(`parallel.pp`, `parallel.tp`) on one device mesh (strategies/mesh.py).

`parallel.strategy` is how data parallelism works across model replicas (single, dp, ddp, fsdp);
`parallel.tp > 1` cuts every block's weights over tensor-parallel ranks (the recipe's plan), and
`parallel.pp > 1` cuts the model into pipeline stages run by `PipelineStrategy`, which wraps each
stage in the data-parallel strategy.

    layout = resolve_parallelism(config.parallel, world_size)   # what `auto` means, the degrees
    check_layout(config.parallel, layout, precision, config.float8)   # combinations that cannot work
    strategy = build_strategy(layout, env=..., device=..., parallel=config.parallel)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from trainmesh.config.schema import STRATEGIES, Float8Config, ParallelConfig
from trainmesh.core.env import DistEnv
from trainmesh.strategies.base import Objective, Strategy
from trainmesh.strategies.ddp import DDPStrategy
from trainmesh.strategies.dp import DataParallelStrategy
from trainmesh.strategies.mesh import ParallelDims, ParallelMesh
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.strategies.schedules import SCHEDULES, schedule_problem
from trainmesh.strategies.single import SingleDeviceStrategy

DISTRIBUTED = ("ddp", "fsdp")  # these need a process group even for one process


class Layout(NamedTuple):
    """A resolved parallel layout: the data-parallel strategy (never `auto`) and the mesh's degrees."""

    strategy: str
    dims: ParallelDims

    @property
    def needs_process_group(self) -> bool:
        return self.strategy in DISTRIBUTED or self.dims.pp * self.dims.tp > 1


__all__ = [
    "DISTRIBUTED",
    "SCHEDULES",
    "Layout",
    "Objective",
    "ParallelDims",
    "ParallelMesh",
    "ParallelPlan",
    "Strategy",
    "build_strategy",
    "check_layout",
    "resolve_parallelism",
]


def resolve_parallelism(parallel: ParallelConfig, world_size: int) -> Layout:
    """The data-parallel strategy `auto` stands for, and the degrees of the mesh; mismatches are user errors."""
    name, tp = parallel.strategy, parallel.tp  # a ParallelConfig holds a valid name (it checks its fields)
    sharded = name == "fsdp" or (name == "auto" and tp != 1)  # ddp cannot hold tensor-parallel weights
    dims = ParallelDims.resolve(
        world_size,
        pp=parallel.pp,
        dp_replicate=parallel.dp_replicate,
        dp_shard=parallel.dp_shard,
        tp=tp,
        sharded=sharded,
    )
    if name == "auto":
        name = ("fsdp" if sharded else "ddp") if dims.dp_size > 1 else "single"
    model_parallel = f" (parallel.pp={dims.pp}, parallel.tp={dims.tp})" if dims.pp * dims.tp > 1 else ""
    if name == "dp" and world_size > 1:
        raise ValueError(
            f"parallel.strategy='dp' drives all local GPUs from ONE process, but the world size is {world_size}. "
            "Fix: --nproc-per-node 1 with dp, or use --parallel.strategy=ddp."
        )
    if name == "single" and dims.dp_size > 1:
        raise ValueError(
            f"parallel.strategy='single' keeps one model replica, but the world size is {world_size}{model_parallel}, "
            f"which leaves {dims.dp_size} data-parallel replicas. "
            "Fix: --parallel.strategy=ddp (or auto), or launch one process."
        )
    if name == "ddp" and dims.tp > 1:
        raise ValueError(
            f"parallel.strategy='ddp' cannot combine with tensor parallelism (parallel.tp={dims.tp}): DDP "
            "all-reduces whole tensors, not tensor-parallel shards. Fix: --parallel.strategy=fsdp (TP × FSDP)."
        )
    if name == "fsdp" and dims.dp_shard == 1 and dims.dp_replicate > 1:
        replicate = "--parallel.strategy=ddp for pure replication, or " if dims.tp == 1 else ""
        raise ValueError(
            f"parallel.dp_shard=1 with parallel.dp_replicate={dims.dp_replicate} shards nothing. "
            f"Fix: {replicate}a parallel.dp_shard above 1 (e.g. --parallel.dp_replicate=1 --parallel.dp_shard=-1)."
        )
    return Layout(name, dims)


def check_layout(parallel: ParallelConfig, layout: Layout, precision: str, float8: Float8Config | None = None) -> None:
    """Refuse combinations of a resolved layout with its options or `precision` (train.precision, with its
    `float8` options) that cannot work (ValueError naming the keys and a fix). The one place for these checks:
    `resolve` (trainmesh check, every worker) calls it, and `Runtime` for a layout it resolved itself."""
    name, dims = layout
    model_parallel = f"parallel.pp={dims.pp} / parallel.tp={dims.tp}"
    problem = schedule_problem(parallel.pipeline, dims.pp) if dims.pp > 1 else None
    if problem:
        raise ValueError(problem)
    if dims.pp * dims.tp > 1 and parallel.fsdp.cpu_offload and name == "fsdp":
        raise ValueError(
            f"parallel.fsdp.cpu_offload=true with {model_parallel} is not supported (stages pass activations, and "
            "tensor-parallel layers communicate, on the accelerator). Fix: --parallel.fsdp.cpu_offload=false."
        )
    if dims.pp * dims.tp > 1 and precision == "16-mixed":
        raise ValueError(
            f"train.precision='16-mixed' with {model_parallel}: the loss scaler's overflow check would see only this "
            "rank's part of the gradients, and ranks could disagree on skipping a step. "
            "Fix: --train.precision=bf16-mixed."
        )
    if precision == "fp8-mixed":
        _check_fp8_layout(name, dims, float8 or Float8Config())
    if name == "ddp" and parallel.ddp.comm_hook == "powersgd" and precision == "16-mixed":
        raise ValueError(
            "parallel.ddp.comm_hook='powersgd' with train.precision='16-mixed': PowerSGD's error feedback would hold "
            "gradients in the loss scale of their step, which changes, and an overflow would enter it. "
            "Fix: --train.precision=bf16-mixed (or 32-true), or another parallel.ddp.comm_hook."
        )


def _check_fp8_layout(name: str, dims: ParallelDims, float8: Float8Config) -> None:
    if dims.tp > 1:
        raise ValueError(
            f"train.precision='fp8-mixed' with parallel.tp={dims.tp} is not supported yet: float8 linear layers "
            "need torchao's float8 tensor-parallel styles (Float8ColwiseParallel, Float8RowwiseParallel), and the "
            "recipes' tensor-parallel plans use torch's. Fix: --parallel.tp=1 (fsdp and pipeline parallelism work "
            "with fp8-mixed), or --train.precision=bf16-mixed."
        )
    if float8.fsdp_all_gather and name != "fsdp":
        raise ValueError(
            f"float8.fsdp_all_gather=true, but the data-parallel strategy is {name!r}: only fsdp all-gathers "
            "weights. Fix: --parallel.strategy=fsdp, or --float8.fsdp_all_gather=false."
        )


def build_strategy(
    layout: Layout,
    *,
    env: DistEnv,
    device: torch.device,
    parallel: ParallelConfig | None = None,
    compile: bool = False,
    gather_dtype: torch.dtype | None = None,
) -> Strategy:
    """The strategy of a resolved `layout` (from `resolve_parallelism`) on a mesh of its degrees, with the
    options of `parallel` (parallel.ddp, parallel.fsdp, ...) and `compile` (train.compile). Collective when a
    device mesh is needed (fsdp, pp or tp): every rank builds it together. `gather_dtype`: the dtype fsdp
    gathers parameters in (the precision's)."""
    parallel = parallel or ParallelConfig()
    name, dims = layout
    assert name in STRATEGIES and name != "auto", f"resolve parallel.strategy={name!r} first"
    assert dims.world_size == env.world_size, f"{layout} was resolved for another world size than {env.world_size}"
    needs_mesh = name == "fsdp" or dims.pp > 1 or dims.tp > 1
    mesh = ParallelMesh(dims, device.type) if needs_mesh else None
    every = parallel.activation_checkpointing

    def data_parallel() -> Strategy:
        if name == "fsdp":  # imported here, as the pipeline's: DTensor's second of import where they run
            from trainmesh.strategies.fsdp import FSDPStrategy

            assert mesh is not None
            fsdp = parallel.fsdp
            return FSDPStrategy(
                env, device, fsdp, mesh=mesh, param_dtype=gather_dtype, activation_checkpointing=every, compile=compile
            )
        if name == "ddp":
            return DDPStrategy(env, device, parallel.ddp, mesh=mesh, activation_checkpointing=every, compile=compile)
        if name == "dp":
            return DataParallelStrategy(env, device, activation_checkpointing=every, compile=compile)
        return SingleDeviceStrategy(env, device, mesh=mesh, activation_checkpointing=every, compile=compile)

    if dims.pp > 1:
        from trainmesh.strategies.pipeline import PipelineStrategy

        assert mesh is not None
        return PipelineStrategy(env, device, data_parallel(), parallel.pipeline, mesh=mesh)
    return data_parallel()
