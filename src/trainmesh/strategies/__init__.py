"""Strategies, chosen by name (`parallel.strategy`) and composed with the model-parallel degrees
(`parallel.pp`, `parallel.tp`) on one device mesh (strategies/mesh.py).

`parallel.strategy` is how data parallelism works across model replicas (single, dp, ddp, fsdp);
`parallel.tp > 1` cuts every block's weights over tensor-parallel ranks (the recipe's plan), and
`parallel.pp > 1` cuts the model into pipeline stages run by `PipelineStrategy`, which wraps each
stage in the data-parallel strategy.
"""

from __future__ import annotations

import torch

from trainmesh.runtime.env import DistEnv
from trainmesh.strategies.base import Objective, Strategy
from trainmesh.strategies.blocks import BlockOptions
from trainmesh.strategies.ddp import COMM_HOOKS, DDPOptions, DDPStrategy
from trainmesh.strategies.dp import DataParallelStrategy
from trainmesh.strategies.fsdp import FSDPOptions, FSDPStrategy
from trainmesh.strategies.mesh import MeshShape, ParallelMesh
from trainmesh.strategies.pipeline import SCHEDULES, PipelineOptions, PipelineStrategy
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.strategies.single import SingleDeviceStrategy

STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
DISTRIBUTED = ("ddp", "fsdp")  # these need a process group even for one process

__all__ = [
    "COMM_HOOKS",
    "DISTRIBUTED",
    "SCHEDULES",
    "STRATEGIES",
    "BlockOptions",
    "DDPOptions",
    "FSDPOptions",
    "MeshShape",
    "Objective",
    "ParallelPlan",
    "PipelineOptions",
    "Strategy",
    "build_strategy",
    "resolve_parallelism",
]


def resolve_parallelism(
    name: str, world_size: int, *, pp: int = 1, dp_replicate: int = 1, dp_shard: int = -1, tp: int = 1
) -> tuple[str, MeshShape]:
    """The data-parallel strategy `auto` stands for, and the mesh; mismatches are user errors."""
    if name not in STRATEGIES:
        raise ValueError(f"parallel.strategy={name!r} is not one of {', '.join(STRATEGIES)}")
    sharded = name == "fsdp" or (name == "auto" and tp != 1)  # ddp cannot hold tensor-parallel weights
    shape = MeshShape.resolve(world_size, pp=pp, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, sharded=sharded)
    if name == "auto":
        name = ("fsdp" if sharded else "ddp") if shape.dp_size > 1 else "single"
    model_parallel = f" (parallel.pp={shape.pp}, parallel.tp={shape.tp})" if shape.pp * shape.tp > 1 else ""
    if name == "dp" and world_size > 1:
        raise ValueError(
            f"parallel.strategy='dp' drives all local GPUs from ONE process, but the world size is {world_size}. "
            "Fix: --nproc-per-node 1 with dp, or use --parallel.strategy=ddp."
        )
    if name == "single" and shape.dp_size > 1:
        raise ValueError(
            f"parallel.strategy='single' keeps one model replica, but the world size is {world_size}{model_parallel}, "
            f"which leaves {shape.dp_size} data-parallel replicas. "
            "Fix: --parallel.strategy=ddp (or auto), or launch one process."
        )
    if name == "ddp" and shape.tp > 1:
        raise ValueError(
            f"parallel.strategy='ddp' cannot combine with tensor parallelism (parallel.tp={shape.tp}): DDP "
            "all-reduces whole tensors, not tensor-parallel shards. Fix: --parallel.strategy=fsdp (TP × FSDP)."
        )
    if name == "fsdp" and shape.dp_shard == 1 and shape.dp_replicate > 1:
        replicate = "--parallel.strategy=ddp for pure replication, or " if shape.tp == 1 else ""
        raise ValueError(
            f"parallel.dp_shard=1 with parallel.dp_replicate={shape.dp_replicate} shards nothing. "
            f"Fix: {replicate}a parallel.dp_shard above 1 (e.g. --parallel.dp_replicate=1 --parallel.dp_shard=-1)."
        )
    return name, shape


def build_strategy(
    name: str,
    env: DistEnv,
    device: torch.device,
    ddp: DDPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    blocks: BlockOptions | None = None,
    mesh: MeshShape | None = None,
    gather_dtype: torch.dtype | None = None,
    pipeline: PipelineOptions | None = None,
) -> Strategy:
    """Collective when a device mesh is needed (fsdp, pp or tp): every rank builds it together.
    `mesh`: the degrees (default: data parallelism over the world), checked as `resolve_parallelism` does."""
    given = mesh or MeshShape(dp_shard=-1)
    name, mesh = resolve_parallelism(
        name, env.world_size, pp=given.pp, dp_replicate=given.dp_replicate, dp_shard=given.dp_shard, tp=given.tp
    )
    needs_mesh = name == "fsdp" or mesh.pp > 1 or mesh.tp > 1
    device_mesh = ParallelMesh(mesh, device.type) if needs_mesh else None

    def data_parallel() -> Strategy:
        if name == "fsdp":
            assert device_mesh is not None
            return FSDPStrategy(env, device, device_mesh, fsdp or FSDPOptions(), gather_dtype, blocks)
        if name == "ddp":
            return DDPStrategy(env, device, ddp or DDPOptions(), blocks, device_mesh)
        if name == "dp":
            return DataParallelStrategy(env, device, blocks)
        return SingleDeviceStrategy(env, device, blocks, device_mesh)

    if mesh.pp > 1:
        assert device_mesh is not None
        return PipelineStrategy(env, device, device_mesh, data_parallel(), pipeline or PipelineOptions())
    return data_parallel()
