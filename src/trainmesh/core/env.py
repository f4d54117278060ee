"""Who am I in the job? `DistEnv` is read once: from torchrun, an MPI launcher, SLURM or a plain process, first match
wins, or from a process group that already exists.

Details: docs/internals.md#coreenvpy
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import hostlist

from trainmesh.core.errors import UserError

DEFAULT_MASTER_PORT = 29500


class LauncherEnvError(UserError, RuntimeError):
    """The launcher's environment variables cannot describe this process; the message says what to set."""


@dataclass(frozen=True)
class MPILauncher:
    """Where one MPI implementation's launcher puts a process's coordinates."""

    name: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    set_variable: str
    """How the launcher passes a variable to every rank, for error messages: `{key}` and `{value}` filled in."""


MPI_LAUNCHERS = (
    MPILauncher(
        "Open MPI",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
        "mpirun -x {key}={value}",
    ),
    MPILauncher(
        "MVAPICH2",
        "MV2_COMM_WORLD_RANK",
        "MV2_COMM_WORLD_SIZE",
        "MV2_COMM_WORLD_LOCAL_RANK",
        "MV2_COMM_WORLD_LOCAL_SIZE",
        "mpirun_rsh ... {key}={value} python ... (or mpiexec -genv {key} {value})",
    ),
    MPILauncher(
        "MPICH or Intel MPI (Hydra)",
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
        "mpiexec -genv {key} {value}",
    ),
)


@dataclass(frozen=True)
class DistEnv:
    """The coordinates of this process in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "torchrun", "mpi", "slurm", "single", or "adopted" (a process group that existed already)

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
        for launcher in MPI_LAUNCHERS:
            if launcher.rank in env and launcher.size in env:
                return _from_mpi(env, launcher)
        if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
            return _from_slurm(env)
        return cls(0, 0, 1, 1, "127.0.0.1", _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT), "single")

    @classmethod
    def from_process_group(
        cls,
        rank: int,
        world_size: int,
        local_rank: int | None = None,
        local_world_size: int | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> DistEnv:
        """This process in a process group that exists already (Ray Train, a user's script or a test set it up),
        as rank `rank` of `world_size` (the group's own numbers, core.dist.existing_group_env).

        The node-local coordinates are as given (Ray Train's context knows them); else the environment's when it
        describes this very group (torchrun's variables, which Ray Train sets too); else those of one node.
        """
        try:
            env = cls.from_environ(environ)
        except (LauncherEnvError, ValueError):  # the group is what counts; variables that cannot be read describe none
            env = cls(0, 0, 1, 1, "127.0.0.1", DEFAULT_MASTER_PORT, "single")
        if local_rank is None and local_world_size is None:
            if (env.rank, env.world_size) == (rank, world_size):
                return replace(env, source="adopted")
            local_rank, local_world_size = rank, world_size  # a group set up by hand, on one node
        if local_rank is None or local_world_size is None:
            raise ValueError(
                f"local_rank={local_rank} and local_world_size={local_world_size}: give both or neither "
                "(neither: taken from LOCAL_RANK/LOCAL_WORLD_SIZE when they describe the group)"
            )
        if not (0 <= rank < world_size and 0 <= local_rank < local_world_size <= world_size):
            raise ValueError(
                f"rank {rank} of {world_size}, local rank {local_rank} of {local_world_size} on its node: need "
                "0 <= rank < world size and 0 <= local rank < local world size <= world size"
            )
        return cls(rank, local_rank, world_size, local_world_size, env.master_addr, env.master_port, "adopted")

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
            raise LauncherEnvError(f"environment variable {key} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LauncherEnvError(f"environment variable {key}={raw!r} is not an integer") from None


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    _refuse_pod_ranks(env, rank, world)
    local_rank = _int(env, "LOCAL_RANK", 0)
    local_world = _int(env, "LOCAL_WORLD_SIZE", world if world == 1 else 1)
    if not 0 <= rank < world:
        raise LauncherEnvError(f"RANK={rank} is outside 0..WORLD_SIZE-1 (WORLD_SIZE={world})")
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    return DistEnv(rank, local_rank, world, local_world, addr, _int(env, "MASTER_PORT", 29500), "torchrun")


def _refuse_pod_ranks(env: Mapping[str, str], rank: int, world: int) -> None:
    """Kubeflow's training operator gives each pod of a PyTorchJob with a Master RANK = the pod's index and
    WORLD_SIZE = pods x nprocPerNode, for torchrun to replace per process (it always sets LOCAL_RANK). A
    process that sees them without LOCAL_RANK was started directly in the pod: with several processes per pod
    it would wait forever for ranks that never start."""
    per_pod = env.get("PET_NPROC_PER_NODE", "")
    if "LOCAL_RANK" not in env and per_pod.isdigit() and int(per_pod) > 1:
        raise LauncherEnvError(
            f"RANK={rank} and WORLD_SIZE={world} number the pods of a Kubeflow PyTorchJob, not processes "
            f"(PET_NPROC_PER_NODE={per_pod}, and no LOCAL_RANK: no torchrun started this process). Fix: make the "
            f"container's command `trainmesh run <recipe> ...`, which starts {per_pod} processes per pod (see "
            "`trainmesh k8s`), or set nprocPerNode: 1 to run one process per pod."
        )


def _from_mpi(env: Mapping[str, str], mpi: MPILauncher) -> DistEnv:
    """A process started by `mpirun`/`mpiexec`: the launcher numbers the processes; the master address must be
    passed to every rank unless all of them run on this node."""
    rank, world = _int(env, mpi.rank), _int(env, mpi.size)
    if not 0 <= rank < world:
        raise LauncherEnvError(f"{mpi.rank}={rank} is outside 0..{mpi.size}-1 ({mpi.size}={world})")
    if mpi.local_rank in env and mpi.local_size in env:
        local_rank, local_world = _int(env, mpi.local_rank), _int(env, mpi.local_size)
    elif "SLURM_LOCALID" in env:  # srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but not Hydra's local variables
        local_rank, local_world = _int(env, "SLURM_LOCALID"), _slurm_tasks_on_this_node(env, world)
    else:
        raise LauncherEnvError(
            f"{mpi.name}: {mpi.rank} and {mpi.size} are set but not {mpi.local_rank}/{mpi.local_size} (the rank "
            f"and the number of ranks on this node), which pick this process's GPU. Fix: start the job with "
            f"{mpi.name}'s own mpirun/mpiexec, or with torchrun or `trainmesh run`."
        )
    port = _int(env, "MASTER_PORT", DEFAULT_MASTER_PORT)
    addr = env.get("MASTER_ADDR", "")
    if not addr:
        if local_world != world:  # ranks on other nodes cannot reach this one's loopback
            set_addr = mpi.set_variable.format(key="MASTER_ADDR", value="<host of rank 0>")
            set_port = mpi.set_variable.format(key="MASTER_PORT", value=str(port))
            raise LauncherEnvError(
                f"{mpi.name} started {world} ranks, {local_world} of them on this node ({mpi.size}={world}, "
                f"{mpi.local_size}={local_world}), and MASTER_ADDR is not set, so the ranks cannot find rank 0. "
                f"Fix: pass the address of rank 0's node to every rank: {set_addr} and {set_port}."
            )
        addr = "127.0.0.1"  # every rank is on this node
    return DistEnv(rank, local_rank, world, local_world, addr, port, "mpi")


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
    # SLURM_NTASKS_PER_NODE is only set with --ntasks-per-node; SLURM_TASKS_PER_NODE ("2(x3),1") always, one
    # count per node of the step in SLURM_NODEID's order.
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    counts = expand_slurm_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ""))
    node = _int(env, "SLURM_NODEID", 0)
    return counts[node] if node < len(counts) else counts[0] if counts else world


def expand_slurm_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed tasks-per-node list, one count per node: '2(x3),1' -> [2, 2, 2, 1]; '' -> []."""
    counts: list[int] = []
    for item in filter(None, value.split(",")):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not match:
            raise LauncherEnvError(f"SLURM_TASKS_PER_NODE={value!r} is not SLURM's form (e.g. '2(x3),1')")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list in SLURM's order ('gpu[01-03,07],login1' -> gpu01 gpu02 gpu03
    gpu07 login1; 'rack[1-2]-node[1-2]' -> rack1-node1 rack1-node2 rack2-node1 rack2-node2), with
    python-hostlist, which handles every documented form (several brackets, text after a bracket)."""
    try:
        return list(hostlist.expand_hostlist(nodelist, sort=False))
    except hostlist.BadHostlist as e:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} is not a SLURM host list: {e}") from None


def launcher_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank for tagging log lines before `DistEnv` is read (0 when the environment is
    inconsistent: reading `DistEnv` then says what is wrong)."""
    try:
        return DistEnv.from_environ(environ).rank
    except (LauncherEnvError, ValueError):
        return 0


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago, for a server to listen on: a random one below the OS's ephemeral range,
    which every outgoing connection (gloo's meshes make many) and bind(0) draw from, so that between now and the
    server's bind only another free_port() can take it; the OS's pick when none below is free."""
    low = _ephemeral_ports()[0]
    draw = random.SystemRandom()  # not the seeded module state: processes seeded alike would draw the same ports
    for port in draw.sample(range(max(1024, low - 10_000), low), 32):
        with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, port))
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _ephemeral_ports() -> tuple[int, int]:
    """The OS's ephemeral port range (Linux's /proc setting; elsewhere, Linux's default)."""
    with contextlib.suppress(OSError, ValueError):
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    return 32768, 60999


# The process environment is read and changed here only (and in launch/spawn.py, which gives a forked test rank
# its whole environment): every other module asks for a variable by name, so what trainmesh reads from the
# environment is listed by `grep -rn 'read_var(\|var_is_set(' src`. tests/unit/test_layers.py keeps it so.


def read_var(name: str, default: str = "") -> str:
    """The variable `name`, or `default` when unset."""
    return os.environ.get(name, default)


def var_is_set(name: str) -> bool:
    return name in os.environ


def current_vars() -> Mapping[str, str]:
    """The whole environment, as it is now (read it, never change it)."""
    return os.environ


def vars_with_prefix(prefixes: tuple[str, ...]) -> list[tuple[str, str]]:
    """Every variable whose name starts with one of `prefixes`, sorted (for `trainmesh env`)."""
    return sorted((k, v) for k, v in os.environ.items() if k.startswith(prefixes))


def restart_count() -> int:
    """How often torchrun's agent on this node has restarted its workers (TORCHELASTIC_RESTART_COUNT; 0: the
    first start, or no torchrun)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(value) if value.isdigit() else 0


def cache_home() -> Path:
    """Where per-user caches go: $XDG_CACHE_HOME, else ~/.cache."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def set_var_default(name: str, value: str) -> str:
    """Set `name` for this process and its children unless it is set; its value."""
    return os.environ.setdefault(name, value)


def set_var(name: str, value: str) -> None:
    os.environ[name] = value


@contextlib.contextmanager
def vars_set(values: Mapping[str, str], defaults: Mapping[str, str] | None = None) -> Iterator[None]:
    """`values` (and `defaults` where unset) in the environment the processes started inside inherit; every
    variable as it was afterwards."""
    defaults = {k: v for k, v in (defaults or {}).items() if k not in os.environ}
    before = {key: os.environ.get(key) for key in [*values, *defaults]}
    os.environ.update({**defaults, **values})
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
