"""`ddp`: DistributedDataParallel — one process per device, gradients all-reduced in buckets.

DDP groups gradients into `bucket_cap_mb` buckets and all-reduces each as soon as its gradients are
ready, overlapping communication with the rest of backward. `no_sync` skips that for non-final
micro-steps of gradient accumulation (gradients accumulate locally and are reduced once). An optional
comm hook compresses buckets to fp16/bf16 for the wire, halving traffic at a small precision cost, or
to a low-rank approximation (PowerSGD, powersgd.py), whose per-rank state checkpoints carry.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from trainmesh.config.schema import DDPConfig
from trainmesh.core.env import DistEnv
from trainmesh.precision.base import Precision
from trainmesh.strategies.base import Objective, Strategy, place
from trainmesh.strategies.mesh import ParallelMesh
from trainmesh.strategies.powersgd import PowerSGD

Hook = Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]]
"""A DDP communication hook: (state, bucket) -> the bucket's averaged gradients, when they arrive."""
HOOKS: dict[str, Hook] = {
    "none": default_hooks.allreduce_hook,  # what DDP does without a hook (torch documents the same results)
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}


class DDPStrategy(Strategy):
    name = "ddp"

    def __init__(
        self,
        env: DistEnv,
        device: torch.device,
        options: DDPConfig | None = None,
        *,
        mesh: ParallelMesh | None = None,
        activation_checkpointing: int = 0,
        compile: bool = False,
    ) -> None:
        super().__init__(env, device, mesh=mesh, activation_checkpointing=activation_checkpointing, compile=compile)
        options = options or DDPConfig()  # its fields check their own values
        if options.comm_hook == "bf16" and device.type != "cuda":
            raise ValueError(
                f"parallel.ddp.comm_hook='bf16' needs NCCL on CUDA GPUs (torch's bf16 hook), but the device is "
                f"{device}. Fix: --parallel.ddp.comm_hook=fp16 (works with gloo) or none."
            )
        self.options = options
        self._powersgd: PowerSGD | None = None
        self._mark: Callable[[str], None] | None = None

    @property
    def compiles_whole_model(self) -> bool:
        return self.mesh is None  # replicas of a pipeline stage or tensor-parallel shards compile block by block

    @property
    def dp_size(self) -> int:
        return self.mesh.dims.dp_size if self.mesh else self.env.world_size

    @property
    def dp_rank(self) -> int:
        return self.mesh.dp_rank if self.mesh else self.env.rank

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        del blocks
        module = place(module, self.device)
        opts = self.options
        buffer_sync: Any = _buffer_sync_kwarg(opts.sync_buffers)
        dp_mesh = self.mesh.dp_mesh if self.mesh else None  # with pipeline stages: the replicas of this stage
        if self.mesh is not None and dp_mesh is None:
            return module  # one replica (every rank a pipeline stage): no gradients to average
        group = dp_mesh.get_group() if dp_mesh is not None else None
        ddp = DistributedDataParallel(
            module,
            process_group=group,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=opts.bucket_cap_mb,
            static_graph=opts.static_graph,
            find_unused_parameters=opts.find_unused_parameters,
            gradient_as_bucket_view=opts.gradient_as_bucket_view,
            **buffer_sync,
        )
        if opts.comm_hook == "powersgd":
            self._powersgd = PowerSGD(ddp, opts.powersgd_rank, opts.powersgd_start_iter)
        hook = self._powersgd.hook if self._powersgd else HOOKS[opts.comm_hook]
        ddp.register_comm_hook(group, self._timed(hook))  # state: the group (None: the world) the hooks reduce over
        return ddp

    def _timed(self, hook: Hook) -> Hook:
        """`hook`, marking the start of the exposed communication when DDP hands it its last bucket (all
        gradients computed: what is left of backward is waiting for the network)."""

        # Unannotated: DDP compares a hook's annotations with the objects, and this module's are strings (PEP 563).
        def timed(state, bucket):  # type: ignore[no-untyped-def]
            if bucket.is_last() and self._mark is not None:
                self._mark("comm")
            return hook(state, bucket)

        return timed

    def forward_backward(
        self,
        module: nn.Module,
        batch: Any,
        objective: Objective,
        scale: Callable[[], float],
        precision: Precision,
        mark: Callable[[str], None] | None = None,
    ) -> torch.Tensor:
        self._mark = mark  # for the hook, which DDP calls during backward
        return super().forward_backward(module, batch, objective, scale, precision, mark)

    def rank_state(self) -> dict[str, Any]:
        return {"powersgd": self._powersgd.rank_state()} if self._powersgd else {}

    def load_rank_state(self, saved: dict[str, Any]) -> None:
        if self._powersgd is not None:
            self._powersgd.load_rank_state(saved.get("powersgd"))

    def on_skipped_step(self) -> None:
        if self._powersgd is not None:
            self._powersgd.reset()  # its error feedback and Qs hold the non-finite gradient now

    @property
    def hears_of_skips(self) -> bool:
        return self._powersgd is not None

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        if enabled and isinstance(module, DistributedDataParallel):
            with module.no_sync():
                yield
        else:
            yield


def _buffer_sync_kwarg(enabled: bool) -> dict[str, bool]:
    """torch 2.13 renamed `broadcast_buffers` to `forward_sync_buffers`; use the name this torch has."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": enabled}
    return {"broadcast_buffers": enabled}
