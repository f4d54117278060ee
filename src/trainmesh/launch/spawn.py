"""Testing distributed code on one machine: `run_distributed` runs a function in N gloo ranks on loopback, forked from a
preloaded server, with a hard timeout (also `trainmesh.testing`'s).

Details: docs/internals.md#launchspawnpy
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import time
import traceback
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

import torch

from trainmesh.core.env import free_port


class DistributedTestError(RuntimeError):
    pass


def run_distributed(
    fn: Callable[..., Any], world_size: int = 2, args: tuple[Any, ...] = (), timeout_s: float = 45.0
) -> list[Any]:
    """Run `fn(rank, *args)` on `world_size` ranks; returns each rank's result, in rank order."""
    ctx = _context()
    results: mp.Queue[tuple[int, bool, bytes | str]] = ctx.Queue()
    port = free_port()
    env = dict(os.environ)  # as it is now: the server was started with the environment of its time
    output = (_InheritedFd(1), _InheritedFd(2))  # where ranks print: this process's stdout and stderr, now
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args, env, output), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(collected))
                raise DistributedTestError(f"ranks {missing} did not finish within {timeout_s:.0f}s")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in collected]
                if dead:
                    code = procs[dead[0]].exitcode
                    raise DistributedTestError(f"rank {dead[0]} died with exit code {code} before reporting") from None
                continue
            if not ok:
                raise DistributedTestError(f"rank {rank} raised:\n{payload!s}")
            assert isinstance(payload, bytes)
            collected[rank] = torch.load(io.BytesIO(payload), weights_only=True)
    finally:
        for proc in procs:
            proc.join(timeout=5 if len(collected) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    return [collected[r] for r in range(world_size)]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    """The variables torchrun would give rank `rank` of a single-node job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": "1",
    }


def _context() -> mp.context.ForkServerContext | mp.context.SpawnContext:
    """Forkserver with torch and trainmesh preloaded where the platform has it, else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # Used when the server starts (once): what every rank would import (DDP imports torch._dynamo, 0.6 s), and
    # what rank 0 writes run files with.
    preload = ["torch", "torch._dynamo", "trainmesh.job.worker", "matplotlib.pyplot", "torch.utils.tensorboard"]
    ctx.set_forkserver_preload(preload)
    return ctx


class _InheritedFd:
    """One of this process's file descriptors, duplicated into a rank as it starts. A forked server's
    children would otherwise write to the descriptors the server had when it started, not to where this
    process writes now (pytest's capture, say)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return (_detach, (reduction.DupFd(self.fd),))  # pickled as the rank starts: the fd goes with it


def _detach(duplicate: Any) -> int:
    return int(duplicate.detach())


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    results: mp.Queue[Any],
    args: tuple[Any, ...],
    env: dict[str, str],
    output: tuple[int, int],
) -> None:
    for fd, target in zip(output, (1, 2), strict=True):
        os.dup2(fd, target)
        os.close(fd)
    os.environ.clear()
    os.environ.update({**env, **rank_environment(rank, world_size, port)})
    torch.set_num_threads(1)
    try:
        value = fn(rank, *args)
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
