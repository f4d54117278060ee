"""hvd.init() and who-am-I (rank, size, local and cross ranks) on torch.distributed's default process group: adopted
when one exists, else joined as trainmesh's workers join it.

Details: docs/internals.md#compathorovodbasicspy
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable, Sequence
from enum import IntEnum
from types import TracebackType

import torch
import torch.distributed as dist

from trainmesh.config.schema import DistConfig
from trainmesh.core.dist import existing_group_env, init_process_group, select_device, teardown
from trainmesh.core.env import DistEnv, read_var


class ReduceOp(IntEnum):
    """Horovod's reduction operations (hvd.Average, hvd.Sum, ...), compared by value as Horovod's are."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp.Average,
    ReduceOp.Sum,
    ReduceOp.Adasum,
    ReduceOp.Min,
    ReduceOp.Max,
    ReduceOp.Product,
)

NOT_INITIALIZED = "Horovod has not been initialized; use hvd.init()."


class _State:
    """This process's place in the job, set by init(); `owns_group`: init() created the group (destroyed at exit),
    rather than adopting one that somebody else will destroy."""

    env: DistEnv | None = None
    owns_group = False
    kept: DistEnv | None = None  # the group init() created, after shutdown(): the next init() takes it again
    check = True  # agreement.py's check before each collective (TRAINMESH_HOROVOD_CHECK=0: off)
    failed = False  # an exception reached the top of the script: leave at exit without waiting for the others


_state = _State()
at_shutdown: list[Callable[[], None]] = []  # what other modules forget at hvd.shutdown() (the process sets)


def init(comm: object = None, process_sets: Sequence[object] | str | None = None) -> None:
    """Join the job's process group (or adopt the existing one); calling it again does nothing. `process_sets`:
    hvd.ProcessSet objects (or lists of ranks) to add, as Horovod's; "dynamic" is accepted (every set is)."""
    if comm is not None:
        raise ValueError(
            f"hvd.init(comm={comm!r}): MPI communicators are not supported; trainmesh.compat.horovod runs on "
            "torch.distributed's default process group (all ranks). Fix: call hvd.init() without comm."
        )
    if is_initialized():
        return
    _join()
    if process_sets is not None and process_sets != "dynamic":
        from trainmesh.compat.horovod.process_sets import add_process_set  # imports this module: import it late

        for process_set in process_sets:
            add_process_set(process_set)  # type: ignore[arg-type]  # add_process_set checks it


def _join() -> None:
    _state.check = read_var("TRAINMESH_HOROVOD_CHECK", "1") != "0"
    if _state.kept is not None and dist.is_initialized():
        _state.env, _state.owns_group, _state.kept = _state.kept, True, None
        return
    adopted = existing_group_env()
    if adopted is not None:
        _state.env, _state.owns_group = adopted, False
        return
    env = DistEnv.from_environ()
    device = select_device("auto", env)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    defaults = DistConfig()  # the same timeouts as trainmesh run's workers (dist.timeout_s, dist.init_timeout_s)
    init_process_group(env, backend, device, defaults.timeout_s, required=True, init_timeout_s=defaults.init_timeout_s)
    _state.env, _state.owns_group = env, True
    _leave_at_exit()


def _leave_at_exit() -> None:
    """Horovod scripts rarely call hvd.shutdown(): Horovod shuts down at exit, and so do we. A gloo group still
    alive when the interpreter exits can abort the process (torch 2.13: "terminate called without an active
    exception", SIGABRT, seen in 1 of 4 runs of the example), so a script that finishes destroys it, after a
    barrier (core.dist.teardown). One that fails does not wait for the others: it is about to exit anyway."""
    previous = sys.excepthook

    def note_failure(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        _state.failed = True
        previous(kind, error, tb)

    sys.excepthook = note_failure
    atexit.register(_leave)


def _leave() -> None:
    """At exit: destroy the group init() created (after shutdown() too), unless the script failed."""
    owned = _state.kept is not None or (_state.env is not None and _state.owns_group)
    _state.env, _state.owns_group, _state.kept = None, False, None
    if owned and not _state.failed:
        teardown(success=True)


def shutdown() -> None:
    """Leave Horovod: is_initialized() is False and calls raise until the next init().

    A process group init() created stays alive for that next init() and is destroyed at exit: Horovod scripts
    (and Horovod's own tests) call init() again after shutdown(), and a new gloo group meeting on the same
    rendezvous can read the old group's peer addresses (gloo: "Connection refused") or wait forever for a store
    that its rank 0 has just closed."""
    if _state.env is not None and _state.owns_group:
        _state.kept = _state.env
    _state.env, _state.owns_group = None, False
    for forget in at_shutdown:
        forget()


def is_initialized() -> bool:
    return _state.env is not None and dist.is_initialized()


def _env() -> DistEnv:
    if not is_initialized():
        raise ValueError(NOT_INITIALIZED)
    assert _state.env is not None
    return _state.env


def rank() -> int:
    return _env().rank


def size() -> int:
    return _env().world_size


def local_rank() -> int:
    return _env().local_rank


def local_size() -> int:
    return _env().local_world_size


def cross_rank() -> int:
    """The rank of this process's node (nodes are assumed to run the same number of processes, as torchrun's)."""
    return _env().node_rank


def cross_size() -> int:
    """The number of nodes."""
    return _env().num_nodes


def is_homogeneous() -> bool:
    return True  # torchrun starts the same number of processes on every node


def mpi_threads_supported() -> bool:
    return False  # no MPI underneath


def mpi_built() -> bool:
    return False  # trainmesh.compat.horovod never uses MPI, whatever torch was built with


def mpi_enabled() -> bool:
    return False


def gloo_built() -> bool:
    return dist.is_gloo_available()


def gloo_enabled() -> bool:
    return is_initialized() and "gloo" in str(dist.get_backend())


def nccl_built() -> int:
    """NCCL's version code (NCCL_VERSION_CODE: 22703 for 2.27.3, 2708 for 2.7.8) when this torch has NCCL, else 0:
    Horovod's value, which scripts and its tests compare with versions (`hvd.nccl_built() >= 2700`)."""
    if not dist.is_nccl_available():
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * (1000 if major <= 2 and minor <= 8 else 10000) + minor * 100 + patch


def cuda_built() -> bool:
    return torch.backends.cuda.is_built()


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    raise NotImplementedError(
        f"hvd.start_timeline({file_path!r}): Horovod's timeline is not supported by trainmesh.compat.horovod. "
        "Fix: record the collectives with torch.profiler (they appear as c10d/gloo/nccl events)."
    )


def stop_timeline() -> None:
    raise NotImplementedError("hvd.stop_timeline(): Horovod's timeline is not supported; use torch.profiler.")


def checks_collectives() -> bool:
    """Whether the ranks check that they agree on each collective before it runs (agreement.py)."""
    return _state.check
