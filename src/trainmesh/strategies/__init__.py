"""Strategies, chosen by name (`parallel.strategy`)."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh

from trainmesh.runtime.env import DistEnv
from trainmesh.strategies.base import LossFn, Strategy
from trainmesh.strategies.blocks import BlockOptions
from trainmesh.strategies.ddp import COMM_HOOKS, DDPOptions, DDPStrategy
from trainmesh.strategies.dp import DataParallelStrategy
from trainmesh.strategies.fsdp import FSDPOptions, FSDPStrategy
from trainmesh.strategies.mesh import MeshShape
from trainmesh.strategies.single import SingleDeviceStrategy

STRATEGIES = ("auto", "single", "dp", "ddp", "fsdp")
DISTRIBUTED = ("ddp", "fsdp")  # these need a process group even for one process

__all__ = [
    "COMM_HOOKS",
    "DISTRIBUTED",
    "STRATEGIES",
    "BlockOptions",
    "DDPOptions",
    "FSDPOptions",
    "LossFn",
    "MeshShape",
    "Strategy",
    "build_strategy",
    "resolve_strategy_name",
]


def resolve_strategy_name(name: str, world_size: int) -> str:
    """`auto` is `ddp` with several processes and `single` otherwise; mismatches are user errors."""
    if name not in STRATEGIES:
        raise ValueError(f"parallel.strategy={name!r} is not one of {', '.join(STRATEGIES)}")
    if name == "auto":
        return "ddp" if world_size > 1 else "single"
    if name == "dp" and world_size > 1:
        raise ValueError(
            f"parallel.strategy='dp' drives all local GPUs from ONE process, but the world size is {world_size}. "
            "Fix: --nproc-per-node 1 with dp, or use --parallel.strategy=ddp."
        )
    if name == "single" and world_size > 1:
        raise ValueError(
            f"parallel.strategy='single' runs one process, but the world size is {world_size}. "
            "Fix: --parallel.strategy=ddp (or auto), or launch one process."
        )
    return name


def build_strategy(
    name: str,
    env: DistEnv,
    device: torch.device,
    ddp: DDPOptions | None = None,
    fsdp: FSDPOptions | None = None,
    blocks: BlockOptions | None = None,
    mesh: MeshShape | None = None,
    gather_dtype: torch.dtype | None = None,
) -> Strategy:
    name = resolve_strategy_name(name, env.world_size)
    if name == "fsdp":
        shape = mesh or MeshShape.resolve(env.world_size)
        device_mesh = init_device_mesh(device.type, shape.dims, mesh_dim_names=shape.names)
        return FSDPStrategy(env, device, device_mesh, fsdp or FSDPOptions(), gather_dtype, blocks)
    if name == "ddp":
        return DDPStrategy(env, device, ddp or DDPOptions(), blocks)
    if name == "dp":
        return DataParallelStrategy(env, device, blocks)
    return SingleDeviceStrategy(env, device, blocks)
