"""Who am I in the job? `DistEnv` is read once, from torchrun, SLURM or a plain process.

Precedence: torchrun's variables (RANK/LOCAL_RANK/WORLD_SIZE, also set by `trainmesh run`) win; then
SLURM's (`srun python -m trainmesh ...`: SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID and the node list,
whose first host becomes the master); otherwise a single plain process (world size 1).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class DistEnv:
    """The coordinates of this process in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "slurm" or "single": where the values came from

    @property
    def node_rank(self) -> int:
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> DistEnv:
        env = os.environ if environ is None else environ
        if "RANK" in env and "WORLD_SIZE" in env:
            return _from_torchrun(env)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return _from_slurm(env)
        return cls(0, 0, 1, 1, "127.0.0.1", _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), "single")

    def export(self) -> dict[str, str]:
        """The torchrun-style variables that `init_process_group(init_method='env://')` reads."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise RuntimeError(f"environment variable {key} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise RuntimeError(f"environment variable {key}={raw!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world if world == 1 else 1)
    if not 0 <= rank < world:
        raise RuntimeError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    return DistEnv(rank, local_rank, world, local_world, addr, _int(env, "MASTER_PORT", 29500), "torchrun")


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
    local_rank = _int(env, "SLURM_LOCALID", 0)
    local_world = _slurm_tasks_on_this_node(env, world)
    nodes = expand_slurm_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    addr = env.get("MASTER_ADDR") or (nodes[0] if nodes else "127.0.0.1")
    # A port derived from the job id lets several jobs share a node without agreeing on one by hand.
    default_port = 20000 + int(env.get("SLURM_JOB_ID", "9500")) % 20000
    return DistEnv(rank, local_rank, world, local_world, addr, _int(env, "MASTER_PORT", default_port), "slurm")


def _slurm_tasks_on_this_node(env: Mapping[str, str], world: int) -> int:
    # SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; SLURM_TASKS_PER_NODE ("2(x3),1") always.
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    tasks = env.get("SLURM_TASKS_PER_NODE", "")
    match = re.match(r"(\d+)", tasks)
    return int(match.group(1)) if match else world


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list in SLURM's order ('gpu[01-03,07],login1' -> gpu01 gpu02 gpu03
    gpu07 login1; 'rack[1-2]-node[1-2]' -> rack1-node1 rack1-node2 rack2-node1 rack2-node2), with
    python-hostlist, which handles every documented form (several brackets, text after a bracket)."""
    try:
        return list(hostlist.expand_hostlist(nodelist, sort=False))
    except hostlist.BadHostlist as e:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM host list: {e}") from None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it; a race with other binders is possible)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
