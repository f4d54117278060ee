"""Device, backend and process group: chosen from the environment, overridable, torn down cleanly."""

from __future__ import annotations

import os
import random
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from trainmesh.runtime.env import DistEnv, free_port
from trainmesh.runtime.logging import get_logger

log = get_logger(__name__)

DEVICES = ("auto", "cpu", "cuda", "mps")
BACKENDS = ("auto", "nccl", "gloo", "mpi")


def select_device(requested: str, env: DistEnv) -> torch.device:
    """`auto`: this rank's GPU (cuda:LOCAL_RANK) when CUDA is present, else MPS for one process, else CPU."""
    if requested not in DEVICES:
        raise ValueError(f"dist.device={requested!r} is not one of {', '.join(DEVICES)}")
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif _mps_available() and env.local_world_size == 1:
            requested = "mps"
        else:
            requested = "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(
                "dist.device='cuda' but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
                "Fix: run on a GPU machine, install a CUDA build of torch, or set --dist.device=cpu."
            )
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise RuntimeError(
                f"LOCAL_RANK={env.local_rank} but only {count} GPU(s) are visible on this node "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
                f"Fix: --nproc-per-node {count} (or 'auto')."
            )
        return torch.device("cuda", env.local_rank)
    if requested == "mps" and not _mps_available():
        raise RuntimeError("dist.device='mps' but MPS is not available. Fix: set --dist.device=cpu.")
    return torch.device(requested)


def select_backend(requested: str, device: torch.device) -> str:
    """`auto`: NCCL for CUDA tensors, gloo for everything else."""
    if requested not in BACKENDS:
        raise ValueError(f"dist.backend={requested!r} is not one of {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise ValueError(
            f"dist.backend='nccl' needs CUDA tensors, but the device is {device}. "
            "Fix: --dist.backend=gloo (or auto) on CPU."
        )
    available = {
        "nccl": dist.is_nccl_available(),
        "gloo": dist.is_gloo_available(),
        "mpi": dist.is_mpi_available(),
    }
    if not available[requested]:
        have = ", ".join(name for name, ok in available.items() if ok) or "none"
        raise ValueError(f"dist.backend={requested!r} is not built into this torch (available: {have}).")
    return requested


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()


def init_process_group(
    env: DistEnv, backend: str, device: torch.device, timeout_s: float, required: bool = False
) -> None:
    """Join the job's process group.

    A single process needs none unless `required` (DDP insists on a group even for world size 1); it
    then gets a private one on a free loopback port.
    """
    if dist.is_initialized() or not (env.is_distributed or required):
        return
    if env.source == "single":
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    for key, value in env.export().items():  # SLURM: give env:// what torchrun would have set
        os.environ.setdefault(key, value)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.debug(
        "init_process_group backend=%s world=%d master=%s:%d", backend, env.world_size, env.master_addr, env.master_port
    )
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend=backend,
        store=_attempt_store(env, timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def _attempt_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store, with every key namespaced by torchrun's restart attempt.

    Under torchrun the store outlives a failed attempt (the agent hosts it), and a restarted group can
    read the dead attempt's peer addresses before the new ones are written: gloo then fails with
    "connection refused" (seen with torch 2.13 in about 2 restarts of 3; cf. pytorch/pytorch#167288).
    A per-attempt prefix makes every attempt meet on fresh keys.
    """
    agent_hosts_it = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        env.world_size,
        is_master=env.rank == 0 and not agent_hosts_it,
        timeout=timeout,
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"trainmesh/attempt-{attempt}", store)


def teardown(success: bool) -> None:
    """Leave the process group without hanging.

    Only after success: after an error a peer may never arrive and `destroy_process_group` could block
    (torchtitan does the same). A failing process is about to exit, which releases the group anyway,
    and every second spent here is a second in which torchrun may kill it before its error is reported.
    """
    if not dist.is_initialized() or not success:
        return
    # Workaround for pytorch/pytorch#56297 (~ProcessGroupGloo blocks while holding the GIL): a DDP
    # Reducer that outlives this call frees the group later, during garbage collection, and joins
    # gloo threads; one still freeing a tensor of the last collective needs the GIL -> deadlock
    # (seen with torch 2.13, about 1 exit in 10). So let every collective finish (barrier) and give
    # those threads a moment without the GIL to drop their last work items before destroying.
    dist.barrier()
    time.sleep(0.05)
    dist.destroy_process_group()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) with one number."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def set_deterministic(enabled: bool) -> None:
    """Deterministic kernels (bit-reproducible runs) at some speed cost."""
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.benchmark = not enabled
