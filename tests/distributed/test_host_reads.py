"""No host read of a step's result inside the training step: trainmesh's own reads (`item`, `float`, `int`, `bool`,
`tolist`) of floating-point and boolean tensors on every rank of a run, counted as the run makes them. On a GPU
each such read waits for the device to drain, and the next step's kernels start late."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from support import train_rank
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

READS = ("item", "__float__", "__int__", "__bool__", "tolist")
STEPS = 100


def counted_run(rank: int, root: str, overrides: list[str]) -> dict[str, Any]:
    """`train_rank` with every read of a floating-point or boolean tensor made by trainmesh's own code counted, by
    the line that made it."""
    reads: Counter[str] = Counter()

    def counting(name: str) -> None:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            caller = sys._getframe(1).f_code
            if (self.is_floating_point() or self.dtype == torch.bool) and "/trainmesh/" in caller.co_filename:
                reads[f"{Path(caller.co_filename).name}:{caller.co_name}"] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, read)

    for name in READS:
        counting(name)
    result = train_rank(rank, root, overrides)
    return {**result, "reads": dict(reads)}


@pytest.mark.parametrize(("world", "strategy"), [(1, "single"), (2, "ddp"), (2, "fsdp")])
def test_a_run_reads_its_results_back_at_the_logging_windows_only(tmp_path: Path, world: int, strategy: str) -> None:
    """100 steps, a window every 20: the skip decision, the target count, the loss and the norm come back once a
    window (and at the final evaluation and checkpoint), under 0.2 reads a step, on every rank of every strategy
    (the ranks' agreement on a skip and the stop votes included). With the fused AdamW (the default on a GPU) the
    optimizer skips a non-finite step on the device."""
    run = [
        f"--parallel.strategy={strategy}",
        f"--train.max_steps={STEPS}",
        "--run.log_every=20",
        "--train.eval_every=0",
        "--optim.fused=true",
        "--train.grad_clip=1.0",
    ]
    results = run_distributed(counted_run, world, args=(str(tmp_path), run))
    for rank, result in enumerate(results):
        reads = result["reads"]
        assert sum(reads.values()) < 0.2 * STEPS, (rank, reads)
    assert len(results[0]["losses"]) == STEPS // 20  # every window logged, with its loss


def host_group_rank(rank: int, backend: str) -> tuple[list[int], bool]:
    """The step's integers summed with the default group reporting `backend` (what NCCL, MPI or a device-type
    backend would say); whether a gloo group of its own was made for them."""
    from trainmesh.config.schema import DistConfig
    from trainmesh.runtime.runtime import Runtime

    rt = Runtime(dist_config=DistConfig(device="cpu", backend="gloo", timeout_s=20), strategy="ddp")
    real = torch.distributed.get_backend
    torch.distributed.get_backend = lambda group=None: backend  # type: ignore[assignment]
    try:
        counts = rt.all_reduce_async([rank + 1, 1]).result()
    finally:
        torch.distributed.get_backend = real
        made = rt._gloo_group is not None
        rt.teardown()
    return counts, made


@pytest.mark.parametrize(
    ("backend", "own_group"), [("gloo", False), ("mpi", False), ("cpu:gloo,cuda:nccl", False), ("nccl", True)]
)
def test_the_steps_integers_travel_on_a_cpu_group(backend: str, own_group: bool) -> None:
    """Beside NCCL, a gloo group of all ranks (made at the first step, with dist.timeout_s); where the default group
    takes CPU tensors itself, that one."""
    for counts, made in run_distributed(host_group_rank, 2, args=(backend,)):
        assert counts == [3, 2] and made == own_group
