"""`single`: one model replica, no data-parallel wrapper. The reference every other strategy is compared
with; with parallel.tp or parallel.pp, the one replica spans several ranks."""

from __future__ import annotations

from torch import nn

from trainmesh.strategies.base import Strategy, place


class SingleDeviceStrategy(Strategy):
    name = "single"

    @property
    def compiles_whole_model(self) -> bool:
        return self.mesh is None  # pipeline stages and tensor-parallel blocks compile one by one

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        del blocks
        return place(module, self.device)
