"""DDP features on 2 gloo ranks: options reach DDP, no_sync really skips the all-reduce, compressed
communication still trains, the fp16 loss-scale skip is agreed by every rank, data loaders shard."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from support import train_rank, train_rank_runs
from trainmesh import DDPConfig, ParallelConfig, Runtime
from trainmesh.strategies.ddp import HOOKS
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow


def _gathered(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def no_sync_rank(rank: int) -> dict[str, Any]:
    rt = Runtime(strategy="ddp", seed=0, parallel=ParallelConfig(ddp=DDPConfig(bucket_cap_mb=1.5, static_graph=False)))
    model = rt.setup(nn.Linear(4, 1))
    x = torch.full((2, 4), float(rank + 1))  # different data per rank -> different local gradients
    with rt.no_sync(model, enabled=True):
        model(x).sum().backward()
    local = _gathered(model.module.weight.grad.clone())
    model(x).sum().backward()  # synchronised: accumulated local grads are averaged
    synced = _gathered(model.module.weight.grad.clone())
    result = {
        "differ_in_no_sync": not torch.equal(local[0], local[1]),
        "equal_after_sync": torch.equal(synced[0], synced[1]),
        "bucket_bytes_cap": model.bucket_bytes_cap,
    }
    rt.teardown()
    return result


def test_no_sync_skips_the_all_reduce_and_options_reach_ddp() -> None:
    for result in run_distributed(no_sync_rank, 2):
        assert result["differ_in_no_sync"] and result["equal_after_sync"]
        assert result["bucket_bytes_cap"] == int(1.5 * 1024 * 1024)


def sync_count_rank(rank: int, root: str, strategy: str, micro_batch: int) -> int:
    """`train_rank` for 3 steps of 8 samples on 2 ranks, counting gradient synchronisations: DDP's comm hook
    calls (one bucket) or FSDP's reduce-scatters."""
    calls = [0]

    def counted(real: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return real(*args, **kwargs)

        return call

    if strategy == "ddp":  # the hook --parallel.ddp.comm_hook=fp16 registers
        real_hook = HOOKS["fp16"]

        def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls[0] += 1
            return real_hook(state, bucket)

        HOOKS["fp16"] = hook
        extra = ["--parallel.ddp.comm_hook=fp16", "--parallel.ddp.bucket_cap_mb=1000"]
    else:
        for name in ("reduce_scatter_single", "reduce_scatter_tensor"):  # what FSDP2 calls (torch 2.13: the first)
            if hasattr(dist, name):
                setattr(dist, name, counted(getattr(dist, name)))
        extra = ["--parallel.strategy=fsdp"]
    overrides = ["--train.global_batch=8", "--train.max_steps=3", f"--train.micro_batch={micro_batch}", *extra]
    train_rank(rank, root, [*overrides, f"--run.id={strategy}-{micro_batch}"])
    return calls[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_gradients_are_synchronised_once_per_step_under_accumulation(tmp_path: Path, strategy: str) -> None:
    """4 micro-steps per optimizer step synchronise gradients as often as 1 does: no_sync (or FSDP's
    requires_gradient_sync) holds back all but the last micro-step's."""
    once = run_distributed(sync_count_rank, 2, args=(str(tmp_path), strategy, 4))  # no accumulation
    accumulated = run_distributed(sync_count_rank, 2, args=(str(tmp_path), strategy, 1))  # 4 micro-steps
    assert once[0] > 0 and accumulated == once, (once, accumulated)


def overflow_rank(rank: int) -> dict[str, Any]:
    rt = Runtime(strategy="ddp", precision="16-mixed", seed=0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    before = model.module.weight.detach().clone()
    scale_before = rt.precision.scaler.get_scale()  # type: ignore[attr-defined]
    with rt.autocast():
        loss = model(torch.ones(1, 2)).float().sum()
    rt.backward(loss * (float("inf") if rank == 1 else 1.0))  # only rank 1 overflows
    rt.clip_grad_norm(model, optimizer, 1.0)
    stepped = rt.step(optimizer)
    result = {
        "stepped": stepped,
        "unchanged": torch.equal(model.module.weight, before),
        "scale_lowered": rt.precision.scaler.get_scale() < scale_before,  # type: ignore[attr-defined]
    }
    rt.teardown()
    return result


def test_loss_scale_overflow_on_one_rank_skips_the_step_on_every_rank() -> None:
    for result in run_distributed(overflow_rank, 2):
        assert result == {"stepped": False, "unchanged": True, "scale_lowered": True}


def loader_rank(rank: int) -> dict[str, Any]:
    rt = Runtime(strategy="ddp")
    dataset = TensorDataset(torch.arange(20))
    loader = rt.setup_dataloader(DataLoader(dataset, batch_size=3, shuffle=True), seed=5)
    loader.sampler.set_epoch(0)  # type: ignore[union-attr]
    ids = [int(i) for (batch,) in loader for i in batch]
    result = {
        "ids": ids,
        "sum": float(rt.all_reduce(rank + 1, "sum")),
        "mean": float(rt.all_reduce(rank + 1, "mean")),
        "max": float(rt.all_reduce(rank + 1, "max")),
        "broadcast": rt.broadcast_object(f"from {rank}"),
    }
    rt.teardown()
    return result


def test_setup_dataloader_shards_and_metric_reductions() -> None:
    r0, r1 = run_distributed(loader_rank, 2)
    assert not set(r0["ids"]) & set(r1["ids"]) and set(r0["ids"]) | set(r1["ids"]) == set(range(20))
    assert (r0["sum"], r0["mean"], r0["max"]) == (3.0, 1.5, 2.0)
    assert r0["broadcast"] == r1["broadcast"] == "from 0"


def test_fp16_compressed_gradients_still_train_in_step(tmp_path: Path) -> None:
    """The fp16 hook is really in place: rounding each gradient bucket to 16 bits moves the weights
    (unlike a no-op), by no more than fp16's precision over a few steps."""
    batch = ["--train.micro_batch=4", "--train.global_batch=8", "--train.max_steps=6"]
    runs = [[*batch, "--run.id=plain"], [*batch, "--parallel.ddp.comm_hook=fp16", "--run.id=hooked"]]
    plain, hooked = zip(*run_distributed(train_rank_runs, 2, args=(str(tmp_path), runs)), strict=True)
    for key, value in hooked[0]["params"].items():
        assert torch.equal(value, hooked[1]["params"][key])  # replicas stay identical
    moved = max(float((hooked[0]["params"][k] - v).abs().max()) for k, v in plain[0]["params"].items())
    assert 0 < moved < 1e-2, moved  # observed: about 1e-4 after 6 AdamW steps at lr 1e-2
    assert hooked[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-2)


def test_bf16_compression_is_refused_without_nccl() -> None:
    from trainmesh.core.env import DistEnv
    from trainmesh.strategies.ddp import DDPStrategy

    env = DistEnv(0, 0, 2, 2, "127.0.0.1", 1, "torchrun")
    with pytest.raises(ValueError, match=r"comm_hook='bf16' needs NCCL.*--parallel.ddp.comm_hook=fp16"):
        DDPStrategy(env, torch.device("cpu"), DDPConfig(comm_hook="bf16"))


def collectives_rank(rank: int, root: str, steps: int, log_every: int) -> int:
    """How many all-reduces this rank's training of `steps` steps issued, besides DDP's gradient all-reduces
    (issued by its comm hook, one per bucket, as a plain DDP loop's C++ reducer issues them)."""
    calls = [0]
    original, real_hook = dist.all_reduce, HOOKS["none"]
    in_hook = threading.local()

    def hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        in_hook.active = True
        try:
            return real_hook(state, bucket)
        finally:
            in_hook.active = False

    HOOKS["none"] = hook

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += not getattr(in_hook, "active", False)
        return original(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    run_id = f"--run.id=c{steps}-{log_every}"
    overrides = [f"--train.max_steps={steps}", f"--run.log_every={log_every}", "--train.eval_every=0", run_id]
    train_rank(rank, root, [*overrides, "--checkpoint.final=false", "--sample.max_new_tokens=0"])
    return calls[0]


@pytest.mark.parametrize(("log_every", "per_step"), [(1, 2), (4, 1.25)])
def test_logging_costs_one_collective_a_window(tmp_path: Path, log_every: int, per_step: float) -> None:
    """One all-reduce per step, of the host's target count and stop votes (on the CPU: nothing waits for a device);
    and one per logging window, which brings the window's loss and times in (train/window.py). A plain DDP loop that
    logs its loss every step makes 1 of its own. Fixed costs (evaluation, the last record) cancel out between a short
    and a longer run."""
    runs = [run_distributed(collectives_rank, 2, args=(str(tmp_path), steps, log_every))[0] for steps in (4, 12)]
    assert (runs[1] - runs[0]) / 8 == per_step, runs


def test_a_window_logs_the_mean_loss_of_exactly_its_steps(tmp_path: Path) -> None:
    """Losses ride on later steps' all-reduces: a window of 3 steps still logs the mean of its own 3 steps'."""
    common = ["--train.max_steps=6", "--train.eval_every=0", "--checkpoint.final=false"]
    runs = [[*common, "--run.log_every=1", "--run.id=each"], [*common, "--run.log_every=3", "--run.id=win"]]
    each, windowed = run_distributed(train_rank_runs, 2, args=(str(tmp_path), runs))[0]
    per_step = each["losses"]
    assert len(per_step) == 6 and len(windowed["losses"]) == 2
    for i, loss in enumerate(windowed["losses"]):
        assert loss == pytest.approx(sum(per_step[3 * i : 3 * i + 3]) / 3, rel=1e-9), (i, per_step)
