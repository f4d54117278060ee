"""`single`: one process, one device, no wrapper. The reference every other strategy is compared with."""

from __future__ import annotations

from torch import nn

from trainmesh.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    name = "single"

    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        del blocks
        return module.to(self.device)
