"""A process group that somebody else set up (Ray Train does, in each of its workers) is adopted, not made
again: `Runtime` and `run_worker` take rank and world size from it, use it, and leave it alive for its owner.

Each rank here sets the group up by hand, as Ray Train would, with no torchrun variables describing it (and,
in the first test, with ranks swapped against the ones the process was started with), then hands over."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from support import nano_config, train_rank, train_records
from trainmesh.core.env import DistEnv
from trainmesh.job.worker import run_worker
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def _own_group(rank: int, init_method: str) -> int:
    """Set up a gloo group of 2 by hand, this process as rank 1 - `rank`, and forget torchrun's variables."""
    theirs = 1 - rank
    for key in TORCHRUN_VARIABLES:
        del os.environ[key]
    dist.init_process_group("gloo", init_method=init_method, rank=theirs, world_size=2)
    return theirs


def runtime_rank(rank: int) -> dict[str, Any]:
    theirs = _own_group(rank, "env://")  # MASTER_ADDR/MASTER_PORT as run_distributed set them
    group = dist.group.WORLD
    with Runtime(strategy="ddp") as rt:
        seen = (rt.rank, rt.world_size, rt.local_rank, rt.env.source, rt.owns_group, rt.backend)
        total = float(rt.all_reduce(theirs + 1, "sum"))
    alive = dist.is_initialized() and dist.group.WORLD is group  # not destroyed, and not made again
    after = torch.tensor([1.0])
    dist.all_reduce(after)  # and still works
    try:
        Runtime(strategy="ddp", env=DistEnv(rank, rank, 2, 2, "127.0.0.1", 1, "torchrun"))
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    dist.destroy_process_group()
    return {
        "theirs": theirs,
        "seen": list(seen),
        "total": total,
        "alive": alive,
        "after": float(after),
        "refused": refused,
    }


def test_runtime_adopts_a_group_it_did_not_set_up_and_leaves_it_alive() -> None:
    for rank, got in enumerate(run_distributed(runtime_rank, 2)):
        theirs = 1 - rank
        assert got["seen"] == [theirs, 2, theirs, "adopted", False, "gloo"]  # one node: local rank = rank
        assert got["total"] == 3.0 and got["alive"] and got["after"] == 2.0
        # A DistEnv that places the process elsewhere than the group does is refused, naming both.
        assert f"rank {theirs} of 2 in the process group that exists already" in got["refused"]
        assert f"told it is rank {rank} of 2" in got["refused"]


def worker_rank(rank: int, root: str, overrides: list[str]) -> dict[str, Any]:
    """run_worker in a group set up over tcp:// (no MASTER_ADDR/MASTER_PORT: the stall watchdog runs without
    the store), returning rank 0's weights."""
    init_method = f"tcp://127.0.0.1:{os.environ.pop('MASTER_PORT')}"
    del os.environ["MASTER_ADDR"]
    theirs = _own_group(rank, init_method)
    config = nano_config(Path(root), *overrides)
    params: dict[str, torch.Tensor] = {}
    result = run_worker(config, Path(root) / "runs" / config.run.id)
    params.update({k: v.detach().clone() for k, v in result.model.state_dict().items()})
    alive = dist.is_initialized()
    dist.barrier()
    dist.destroy_process_group()
    return {"theirs": theirs, "alive": alive, "params": params, "train_loss": result.train_loss}


def test_run_worker_in_an_adopted_group_trains_as_its_own_launch_does(tmp_path: Path) -> None:
    """The same nano GPT job, once in a group trainmesh sets up (the reference) and once in one it adopts:
    bit-identical weights. Only the group's rank 0 writes the run folder."""
    overrides = ["--train.global_batch=8", "--train.max_steps=3"]
    reference = run_distributed(train_rank, 2, args=(str(tmp_path), [*overrides, "--run.id=own"]))
    adopted = run_distributed(worker_rank, 2, args=(str(tmp_path), [*overrides, "--run.id=adopted"]))
    for got in adopted:
        assert got["alive"]
        assert got["train_loss"] == reference[0]["train_loss"]
        assert got["params"].keys() == reference[0]["params"].keys()
        for key, value in reference[0]["params"].items():
            assert torch.equal(got["params"][key], value), key
    run_dir = tmp_path / "runs" / "adopted"
    assert (run_dir / "config.toml").is_file()
    assert [r["step"] for r in train_records(run_dir)] == [1, 2, 3]  # one writer: each step logged once
