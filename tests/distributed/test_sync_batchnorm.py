"""SyncBatchNorm on 2 gloo ranks equals BatchNorm on the concatenated batch in one process: outputs,
input gradients, weight/bias gradients (summed over ranks) and running statistics over several steps
with a parameter update between them, also with unequal per-rank batch sizes and momentum=None. The
same comparison fails for BatchNorm with per-rank statistics (the mutation check), and evaluation
never communicates."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from trainmesh import Runtime
from trainmesh.layers import SyncBatchNorm, convert_sync_batchnorm
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

# fp32 throughout; the synced statistics are combined in float64 and differ from BatchNorm's own
# reduction only by rounding: observed |diff| <= 4e-6 on values up to ~25, under half the tolerance.
ATOL, RTOL = 1e-6, 1e-5
STEPS = 3
# name: (per-rank batch sizes, feature shape after (N, C), momentum)
CASES: dict[str, tuple[tuple[int, int], tuple[int, ...], float | None]] = {
    "2d, equal batches": ((4, 4), (3, 5, 5), 0.1),
    "2d, unequal batches": ((3, 5), (3, 4, 4), 0.1),
    "1d, cumulative average": ((4, 4), (6,), None),
}


def _step_data(step: int, sizes: tuple[int, int], features: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The concatenated batch of both ranks and an upstream gradient; the ranks' halves have very
    different distributions, so per-rank statistics are far from the global ones."""
    gen = torch.Generator().manual_seed(100 + step)
    halves = [torch.randn(n, *features, generator=gen) * (1 + 2 * r) + 3 * r for r, n in enumerate(sizes)]
    return torch.cat(halves), torch.randn(sum(sizes), *features, generator=gen)


def _bn(channels: int, dims: int, momentum: float | None) -> nn.Module:
    bn = (nn.BatchNorm1d if dims == 1 else nn.BatchNorm2d)(channels, momentum=momentum)
    with torch.no_grad():  # non-trivial affine parameters
        bn.weight.copy_(torch.linspace(0.5, 1.5, channels))
        bn.bias.copy_(torch.linspace(-0.2, 0.3, channels))
    return bn


def _run(bn: nn.Module, case: str, part: slice, synced: bool) -> list[dict[str, torch.Tensor]]:
    """STEPS forward/backward passes on this rank's `part` of each batch, an SGD update of weight and
    bias with the (summed) gradients after each, then one evaluation pass. Returns per-step records."""
    sizes, features, _ = CASES[case]
    records = []
    for step in range(STEPS):
        x_all, g_all = _step_data(step, sizes, features)
        x = x_all[part].clone().requires_grad_(True)
        y = bn(x)
        (y * g_all[part]).sum().backward()  # each rank's loss; the total is the sum over ranks
        grads = [bn.weight.grad.clone(), bn.bias.grad.clone()]
        if synced:
            for g in grads:
                dist.all_reduce(g)  # what DDP does (up to its 1/world scaling)
        with torch.no_grad():
            for p, g in zip((bn.weight, bn.bias), grads, strict=True):
                p -= 0.1 * g
                p.grad = None
        records.append(
            {
                "out": y.detach(),
                "x_grad": x.grad.clone(),
                "weight_grad": grads[0],
                "bias_grad": grads[1],
                "running_mean": bn.running_mean.clone(),
                "running_var": bn.running_var.clone(),
                "num_batches_tracked": bn.num_batches_tracked.clone(),
            }
        )
    bn.eval()
    x_all, _ = _step_data(STEPS, sizes, features)
    records.append({"eval_out": bn(x_all[part]).detach()})
    bn.train()
    return records


def sync_bn_rank(rank: int) -> dict[str, Any]:
    rt = Runtime(strategy="ddp", seed=0)
    out: dict[str, Any] = {}
    for case, (sizes, features, momentum) in CASES.items():
        start = sum(sizes[:rank])
        part = slice(start, start + sizes[rank])
        channels = features[0]
        reference = _run(_bn(channels, len(features), momentum), case, slice(None), synced=False)
        converted = convert_sync_batchnorm(_bn(channels, len(features), momentum))
        assert isinstance(converted, SyncBatchNorm)
        synced = _run(converted, case, part, synced=True)
        local = _run(_bn(channels, len(features), momentum), case, part, synced=True)  # per-rank statistics
        out[case] = {"part": (part.start, part.stop), "reference": reference, "synced": synced, "local": local}
    if rank == 0:  # evaluation on one rank only: it would hang here if eval mode communicated
        bn = convert_sync_batchnorm(_bn(3, 2, 0.1)).eval()
        bn(torch.randn(2, 3, 4, 4))
    rt.barrier()
    rt.teardown()
    return out


def _compare(
    records: list[dict[str, torch.Tensor]], reference: list[dict[str, torch.Tensor]], part: slice, case: str
) -> None:
    for step, (got, ref) in enumerate(zip(records, reference, strict=True)):
        for key, value in got.items():
            expected = ref[key][part] if key in ("out", "x_grad", "eval_out") else ref[key]
            torch.testing.assert_close(value, expected, atol=ATOL, rtol=RTOL, msg=f"{case}, step {step}: {key}")


def test_sync_batchnorm_equals_batchnorm_on_the_whole_batch() -> None:
    for rank_result in run_distributed(sync_bn_rank, 2, timeout_s=45):
        for case, result in rank_result.items():
            part = slice(*result["part"])
            _compare(result["synced"], result["reference"], part, case)
            # Mutation check: the same comparison must catch statistics computed per rank.
            with pytest.raises(AssertionError):
                _compare(result["local"], result["reference"], part, case)
