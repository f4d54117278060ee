"""`fsdp`: fully sharded data parallel (FSDP2, `fully_shard`) — ZeRO-3 style, or ZeRO-2 style, or hybrid. Each
block, then the root, is one unit whose parameters, gradients and optimizer state are sharded over the `dp_shard`
ranks.

Details: docs/internals.md#strategiesfsdppy
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from trainmesh.config.schema import FSDPConfig
from trainmesh.core.env import DistEnv
from trainmesh.strategies.base import Strategy, place
from trainmesh.strategies.mesh import ParallelMesh


class FSDPStrategy(Strategy):
    name = "fsdp"

    @property
    def collective_forward(self) -> bool:
        return True

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        options: FSDPConfig | None = None,
        *,
        mesh: ParallelMesh,
        param_dtype: torch.dtype | None = None,
        activation_checkpointing: int = 0,
        compile: bool = False,
    ) -> None:
        super().__init__(env, device, mesh=mesh, activation_checkpointing=activation_checkpointing, compile=compile)
        self.options, self.param_dtype = options or FSDPConfig(), param_dtype

    @property
    def shards_parameters(self) -> bool:
        return True

    @property
    def materialize_device(self) -> torch.device:
        return torch.device("cpu") if self.options.cpu_offload else self.device

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        if not self.options.cpu_offload and not any(p.is_meta for p in module.parameters()):
            module = place(module, self.device)
        assert self.mesh is not None
        dp_mesh = self.mesh.dp_mesh
        if dp_mesh is None:  # one replica (e.g. all ranks tensor-parallel): nothing to shard over
            return module
        kwargs: dict[str, Any] = {
            "mesh": dp_mesh,
            "reshard_after_forward": self.options.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32),
        }
        if self.options.cpu_offload:
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
        units = [fully_shard(block, **kwargs) for block in blocks]
        fully_shard(module, **kwargs)  # in place: the module itself is now the root FSDP unit
        self._set_prefetch(units)
        return module

    def _set_prefetch(self, units: list[FSDPModule]) -> None:
        k = self.options.prefetch
        if k <= 0 or len(units) < 2:
            return  # FSDP's own default: the next unit's all-gather is issued when this one's forward starts
        for i, unit in enumerate(units):
            unit.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + k])
            unit.set_modules_to_backward_prefetch(list(reversed(units[max(0, i - k) : i])))

    def unwrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard changes the module in place; it is the user's module

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        """A micro-step before the step's last. By default FSDP keeps this micro-step's gradients whole and
        unsynchronised; with parallel.fsdp.reduce_every_microstep it reduce-scatters them at once and adds them to
        the sharded gradients, and only the all-reduce across hybrid-sharding replicas waits for the last."""
        if not (enabled and isinstance(module, FSDPModule)):
            yield
            return
        every = bool(self.options.reduce_every_microstep)  # auto (None) unresolved by trainmesh run: whole
        hold = module.set_requires_all_reduce if every else module.set_requires_gradient_sync
        hold(False)
        try:
            yield
        finally:
            hold(True)

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        norm = super().clip_grad_norm(module, max_norm)  # the norm of all shards together
        return norm.full_tensor() if isinstance(norm, DTensor) else norm
