"""`dp`: legacy `nn.DataParallel` — one process drives every local GPU.

Each forward scatters the batch over the GPUs, replicates the model from GPU 0 and gathers outputs
back on GPU 0; it is simple but GIL-bound and GPU 0 carries extra memory, which is why `ddp` (one
process per GPU) is the recommended data-parallel strategy. The batch a process reads is split across
its GPUs, so `train.micro_batch` is the per-process (all-GPU) micro-batch here.
"""

from __future__ import annotations

import torch
from torch import nn

from trainmesh.core.env import DistEnv
from trainmesh.strategies.base import Strategy


class DataParallelStrategy(Strategy):
    name = "dp"

    def __init__(
        self, env: DistEnv, device: torch.device, *, activation_checkpointing: int = 0, compile: bool = False
    ) -> None:
        if device.type != "cuda":
            raise ValueError(
                f"parallel.strategy='dp' (nn.DataParallel) needs CUDA GPUs, but the device is {device}. "
                "Fix: on CPU use --parallel.strategy=ddp with several processes "
                "(trainmesh run ... --nproc-per-node 2)."
            )
        assert env.world_size == 1, "resolve_parallelism refuses dp with several processes"
        super().__init__(env, device, activation_checkpointing=activation_checkpointing, compile=compile)
        self.device_ids = list(range(torch.cuda.device_count()))

    @property
    def devices_per_process(self) -> int:
        return len(self.device_ids)

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        del blocks
        module = module.to(self.device)
        if len(self.device_ids) < 2:
            return module  # DataParallel over one GPU only adds overhead
        return nn.DataParallel(module, device_ids=self.device_ids, output_device=self.device_ids[0])
