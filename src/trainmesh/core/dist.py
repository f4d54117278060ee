"""Device, backend and process group: chosen from the environment, overridable, torn down cleanly."""

from __future__ import annotations

import ipaddress
import random
import socket
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from trainmesh.core.env import DistEnv, free_port, read_var, restart_count, set_var, set_var_default, var_is_set
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger

log = get_logger(__name__)


class DeviceError(UserError, RuntimeError):
    """dist.device names a device this machine does not have: a one-line error with the fix, not a traceback."""


def select_device(requested: str, env: DistEnv) -> torch.device:
    """`auto`: this rank's GPU (cuda:LOCAL_RANK) when CUDA is present, else MPS for one process, else CPU."""
    if requested == "auto":
        if torch.cuda.is_available():
            requested = "cuda"
        elif _mps_available() and env.local_world_size == 1:
            requested = "mps"
        else:
            requested = "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                "dist.device='cuda' but torch sees no CUDA GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}). "
                "Fix: run on a GPU machine, install a CUDA build of torch, or set --dist.device=cpu."
            )
        count = torch.cuda.device_count()
        if env.local_rank >= count:
            raise DeviceError(
                f"LOCAL_RANK={env.local_rank} but only {count} GPU(s) are visible on this node "
                f"(CUDA_VISIBLE_DEVICES={read_var('CUDA_VISIBLE_DEVICES', 'unset')}). "
                f"Fix: --nproc-per-node {count} (or 'auto')."
            )
        return torch.device("cuda", env.local_rank)
    if requested == "mps" and not _mps_available():
        raise DeviceError("dist.device='mps' but MPS is not available. Fix: set --dist.device=cpu.")
    return torch.device(requested)


def select_backend(requested: str, device: torch.device) -> str:
    """`auto`: NCCL for CUDA tensors, gloo for everything else."""
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


def existing_group_env(local_rank: int | None = None, local_world_size: int | None = None) -> DistEnv | None:
    """This process's coordinates in the default process group when somebody set one up already (Ray Train,
    a user's script), None when there is none. Rank and world size are the group's; the node-local ones as
    given, else as DistEnv.from_process_group finds them."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return DistEnv.from_process_group(dist.get_rank(), dist.get_world_size(), local_rank, local_world_size)


def current_env() -> DistEnv:
    """Who this process is in the job: the existing default group's rank and size, else the environment's."""
    return existing_group_env() or DistEnv.from_environ()


def init_process_group(
    env: DistEnv,
    backend: str,
    device: torch.device,
    timeout_s: float,
    required: bool = False,
    init_timeout_s: float = 300.0,
    debug: str = "off",
) -> bool:
    """Join the job's process group, or fail within `init_timeout_s` saying what to check; True when this
    call created the group (its creator destroys it: `teardown`).

    A default group that exists already is adopted as it is (False): `env` must place this process in it as
    the group does. A single process needs none unless `required` (DDP insists on a group even for world
    size 1); it then gets a private one on a free loopback port. `debug` sets TORCH_DISTRIBUTED_DEBUG:
    `detail` checks that every rank calls the same collective with the same shapes.
    """
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        if (env.rank, env.world_size) != (rank, world):
            raise RuntimeError(
                f"this process is rank {rank} of {world} in the process group that exists already, but was told "
                f"it is rank {env.rank} of {env.world_size} ({env.source}). Fix: build the DistEnv from the group "
                "(trainmesh.core.dist.existing_group_env()), or pass none."
            )
        log.debug("adopting the existing process group: rank %d of %d, backend %s", rank, world, dist.get_backend())
        if device.type == "cuda":  # NCCL's collectives run on the current device, which its creator may not have set
            torch.cuda.set_device(device)
        return False
    if not (env.is_distributed or required):
        return False
    if env.source == "single":
        set_var_default("MASTER_ADDR", "127.0.0.1")
        set_var_default("MASTER_PORT", str(free_port()))
    for key, value in env.export().items():  # SLURM: give env:// what torchrun would have set
        set_var_default(key, value)
    if debug != "off":
        set_var("TORCH_DISTRIBUTED_DEBUG", debug.upper())
        dist.set_debug_level_from_env()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    addr, port = read_var("MASTER_ADDR"), int(read_var("MASTER_PORT"))
    log.debug("init_process_group backend=%s world=%d master=%s:%d", backend, env.world_size, addr, port)
    try:
        dist.init_process_group(
            backend=backend,
            store=attempt_store(addr, port, env, timedelta(seconds=init_timeout_s)),
            rank=env.rank,
            world_size=env.world_size,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if device.type == "cuda" else None,
        )
    except dist.DistError as e:
        raise RuntimeError(
            f"rank {env.rank} of {env.world_size} could not join the process group at {addr}:{port} within "
            f"dist.init_timeout_s={init_timeout_s:g} s: {str(e).splitlines()[0]}\n"
            f"Check: that the master (rank 0) runs and listens on {addr}:{port} and is reachable from here "
            f"(MASTER_ADDR/MASTER_PORT, firewalls); that all {env.world_size} processes of WORLD_SIZE were "
            "started, with distinct ranks; that the port is not used by another job."
        ) from e
    return True


def group_backend(requested: str, device: torch.device) -> str:
    """The backend of a default group that exists already, which `requested` (dist.backend) must name."""
    backend = str(dist.get_backend())  # "gloo", "nccl", or per device type: "cpu:gloo,cuda:nccl"
    names = {part.rpartition(":")[2] for part in backend.split(",")}
    if requested != "auto" and requested not in names:
        raise ValueError(
            f"dist.backend={requested!r}, but this process's process group was set up before trainmesh started "
            f"(by Ray Train, say) with backend {backend!r}. Fix: --dist.backend=auto, or set the group up with "
            f"{requested!r} (Ray Train: TorchConfig(backend={requested!r}))."
        )
    if device.type == "cuda" and "nccl" not in names:
        log.warning(
            "the existing process group's backend is %r: CUDA tensors are all-reduced through it, more slowly than "
            "through NCCL (Ray Train: use_gpu=True, or TorchConfig(backend='nccl'))",
            backend,
        )
    return backend


def attempt_store(addr: str, port: int, env: DistEnv, timeout: timedelta, client: bool = False) -> dist.Store:
    """The rendezvous store; where torchrun's agent hosts it, every key namespaced by the restart attempt.

    An agent's store outlives a failed attempt, and a restarted group can read the dead attempt's peer
    addresses before the new ones are written: gloo then fails with "connection refused" (seen with
    torch 2.13 in about 2 restarts of 3; cf. pytorch/pytorch#167288). A per-attempt prefix makes every
    attempt meet on fresh keys. Where rank 0 hosts the store (elastic launches, see launch/__init__.py) every
    attempt has a new one, and no prefix is used: TORCHELASTIC_RESTART_COUNT is each agent's own count
    (a membership change does not add to it, and a replacement node starts at 0), so ranks of
    different nodes would look for each other under different prefixes and never meet.
    `client`: one more connection to a store that already runs (for a background thread).
    """
    agent_hosts_it = read_var("TORCHELASTIC_USE_AGENT_STORE").lower() == "true"
    store: dist.Store
    if env.rank == 0 and not agent_hosts_it and not client and is_loopback(addr):
        store = loopback_store(port, timeout, env.world_size)
    else:
        is_master = env.rank == 0 and not agent_hosts_it and not client
        store = dist.TCPStore(addr, port, None if client else env.world_size, is_master=is_master, timeout=timeout)
    if not agent_hosts_it:
        return store
    attempt = str(restart_count())
    return dist.PrefixStore(f"trainmesh/attempt-{attempt}", store)


def loopback_store(port: int, timeout: timedelta, world_size: int | None = None) -> dist.TCPStore:
    """A TCPStore server that listens on 127.0.0.1 only (port 0: a free one; see `.port`).

    A TCPStore alone listens on every interface, which on a single node would expose the job to the
    network for no reason. It can adopt a socket we bound ourselves; `multi_tenant` lets torchrun's
    agent, which opens its store on the same port in this process, share this server.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free; a listened one not
    try:
        sock.bind(("127.0.0.1", port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"port {port} on 127.0.0.1 is already in use (another run, or another program)") from e
    return dist.TCPStore(
        "127.0.0.1",
        sock.getsockname()[1],
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=world_size is not None,
        multi_tenant=True,
        master_listen_fd=sock.detach(),  # the store owns the socket from here on
    )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def store_client(namespace: str, timeout_s: float = 60.0) -> dist.Store | None:
    """A new connection to this job's store, its keys under `namespace`; None without a process group."""
    if not dist.is_initialized():
        return None
    if not (var_is_set("MASTER_ADDR") and var_is_set("MASTER_PORT")):  # set up by other means (tcp://, a file)
        log.debug("no MASTER_ADDR/MASTER_PORT: the process group's store is not known, no store client (%s)", namespace)
        return None
    env = current_env()
    store = attempt_store(
        read_var("MASTER_ADDR"), int(read_var("MASTER_PORT")), env, timedelta(seconds=timeout_s), client=True
    )
    return dist.PrefixStore(namespace, store)


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
        set_var_default("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if enabled != torch.are_deterministic_algorithms_enabled():  # the call imports torch._inductor: 0.6 s
        torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.benchmark = not enabled


def set_tf32(device: torch.device, enabled: bool) -> None:
    """On CUDA, let float32 matmuls (torch.set_float32_matmul_precision "high") and cuDNN convolutions use
    TF32 tensor cores. A process-wide setting; other devices are left as they are."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if enabled else "highest")
        torch.backends.cudnn.allow_tf32 = enabled


def tf32_note(device: torch.device) -> str | None:
    """The line a run logs at start on whether float32 matmuls use TF32 here; None off CUDA, where TF32 does not
    exist (a CPU computes float32 in float32)."""
    if device.type != "cuda":
        return None
    on = torch.get_float32_matmul_precision() != "highest"
    where = "float32 matmuls and cuDNN convolutions on TF32 tensor cores" if on else "full float32 matmuls"
    return f"TF32 matmuls: {'on' if on else 'off'} (train.tf32={str(on).lower()}: {where})"
