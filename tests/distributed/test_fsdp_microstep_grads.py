"""What parallel.fsdp.reduce_every_microstep changes inside an accumulation window: after a micro-step that is not
the step's last, the gradients are already reduce-scattered (each rank holds its shard of the sum so far) with it,
and held whole, unsynchronised, without it. That equal training follows is test_fsdp.py's."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainmesh.config.schema import DistConfig, FSDPConfig, ParallelConfig
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.timeout(120)


def _after_one_microstep(rank: int, every: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    parallel = ParallelConfig(strategy="fsdp", fsdp=FSDPConfig(reduce_every_microstep=every))
    rt = Runtime(strategy="fsdp", parallel=parallel, dist_config=DistConfig(device="cpu"), seed=0)
    model = rt.setup(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)))
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))  # each rank its own data
    with rt.no_sync(model, enabled=True):  # a micro-step before the last
        model(x).square().sum().backward()
    weight = model[0].weight
    grad = weight.grad
    local = grad.to_local() if isinstance(grad, DTensor) else grad
    full = grad.full_tensor() if isinstance(grad, DTensor) else None
    rt.teardown()
    return {"sharded": local is not None and local.shape[0] < 16, "held": grad is not None, "full": full}


def _reference() -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    for rank in range(2):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
    assert model[0].weight.grad is not None
    return model[0].weight.grad / 2  # FSDP's reduce-scatter averages over the ranks


def test_gradients_are_sharded_after_each_microstep_when_asked() -> None:
    every = run_distributed(_after_one_microstep, 2, args=(True,))
    assert all(r["sharded"] for r in every)
    torch.testing.assert_close(every[0]["full"], _reference())


def test_by_default_a_microstep_holds_whole_gradients_unsynchronised() -> None:
    held = run_distributed(_after_one_microstep, 2, args=(False,))
    assert not any(r["held"] for r in held)  # nothing reduced yet: the sharded .grad is still empty
