"""Rounds: how ranks inside hvd.join() keep answering the others' collectives, as under Horovod: every collective begins
with a small header all-reduce that tells a joined rank what to match, and carries the fingerprints by which the
ranks check that they agree on the collective (agreement.py).

Details: docs/internals.md#compathorovodroundspy
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from enum import Enum, IntEnum

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.agreement import Call, agreed, each_rank, refuse
from trainmesh.compat.horovod.basics import ReduceOp, checks_collectives, rank, size
from trainmesh.compat.horovod.errors import HorovodInternalError

HEADER_LEN = 15  # [active ranks, kind, 5 fields, ranks whose own checks failed, ranks in hvd.barrier(), ranks whose
# collective may wait (an *_async call's), of those the ranks waiting for it and those polling it, ranks in a barrier
# with deferred collectives of their own, sum of fingerprints, of squares]
FIELDS = slice(1, 7)
FAILED, BARRIERS, DEFERRABLE, WAITING, POLLING, QUEUED = 7, 8, 9, 10, 11, 12
DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
TORCH_OPS = {
    ReduceOp.Average: dist.ReduceOp.SUM,  # divided by hvd.size() afterwards
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}


class Kind(IntEnum):
    OPTIMIZER = 1
    ALLREDUCE = 2
    OTHER = 3


class RankJoinedError(RuntimeError):
    """A collective that joined ranks cannot answer (Horovod raises for these too)."""


class Role(Enum):
    """How a round may meet other ranks' different rounds: an *_async call's collective waits (deferred, then
    started in call order before this rank's next round) while the other ranks are in hvd.barrier(), which Horovod's
    barrier does not wait for; the barrier's ranks send their round again, first starting their own deferred ones
    when the others wait for or poll theirs. When every async rank waits and not every barrier rank has a deferred
    call to start, no rank can go on: the ranks raise."""

    PLAIN = 0
    BARRIER = 1
    DEFERRABLE = 2


class Deferred(Exception):
    """This rank's deferrable round met the others in hvd.barrier(): its collective did not start."""


# Each group's deferred starts, in call order (None: the global set's group). A start runs its round and collective,
# or raises Deferred again; it keeps any other error for its handle.
_deferred: dict[dist.ProcessGroup | None, deque[Callable[[], None]]] = {}
_flushing: set[dist.ProcessGroup | None] = set()
_asking: dict[dist.ProcessGroup | None, str] = {}  # groups whose deferred calls this rank waits for or polls
deferral_lock = threading.RLock()  # one thread starts a group's deferred collectives at a time


def defer(group: dist.ProcessGroup | None, start: Callable[[], None]) -> None:
    """Queue `start` behind the group's deferred starts (run by the group's next round, or flush())."""
    _deferred.setdefault(group, deque()).append(start)


def flush(group: dist.ProcessGroup | None, asking: str = "") -> bool:
    """Start the group's deferred collectives in call order, until one is deferred again; whether none is left.
    `asking`: "waiting" (this rank cannot go on until one of them has run) or "polling" for one of them."""
    with deferral_lock:
        queue = _deferred.get(group)
        if not queue or group in _flushing:  # flushing: the round is the deferred collective's own, at the head
            return True
        _flushing.add(group)
        if asking:
            _asking[group] = asking
        try:
            while queue:
                try:
                    queue[0]()  # raises Deferred while the other ranks are still in a barrier
                except Deferred:
                    return False
                except Exception:  # its handle keeps the error (the other ranks raised it in their call); a rank
                    queue.popleft()  # that waits cannot go on: it raises it too
                    if asking == "waiting":
                        raise
                    continue
                queue.popleft()
        finally:
            _flushing.discard(group)
            _asking.pop(group, None)
        return True


def forget_deferred() -> None:
    """hvd.shutdown(): deferred collectives never start (their handles say so)."""
    _deferred.clear()


# Each DistributedOptimizer's shadow: what a joined rank runs for that optimizer's gradient round. Indexed in
# creation order, which is the same on every rank (the same script).
_shadows: list[Callable[[], Callable[[], None] | None]] = []


def register_optimizer(shadow: Callable[[], None]) -> int:
    """Register a bound method that shadows one gradient round; returns the index its headers carry."""
    _shadows.append(weakref.WeakMethod(shadow))
    return len(_shadows) - 1


def control_device() -> torch.device:
    """Where headers live: the CPU when the group has gloo (or MPI) for it, else this rank's GPU (NCCL only)."""
    backend = str(dist.get_backend())
    if "gloo" in backend or "mpi" in backend:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise ValueError(f"tensors of dtype {dtype} are not supported; supported: {', '.join(map(str, DTYPES))}")
    return DTYPES.index(dtype)


class Round:
    """A started round: its header all-reduce, perhaps still in flight (all-reduces with the check off)."""

    def __init__(self, header: torch.Tensor | None = None, work: dist.Work | None = None, members: int = 1) -> None:
        self.header, self.work, self.members = header, work, members  # header None: a one-rank group, no round

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
            self.work = None

    def someone_joined(self) -> bool:
        """Whether a rank of the group is inside hvd.join() (waits for the header)."""
        self.wait()
        return self.header is not None and int(self.header[0]) < self.members


def _header(
    kind: Kind,
    fingerprint: int,
    fields: Sequence[int] = (),
    failed: bool = False,
    role: Role = Role.PLAIN,
    asking: str = "",
    queued: bool = False,
) -> torch.Tensor:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1], header[FAILED] = 1, int(kind), int(failed)
    header[BARRIERS], header[DEFERRABLE] = int(role == Role.BARRIER), int(role == Role.DEFERRABLE)
    header[WAITING], header[POLLING] = int(asking == "waiting"), int(asking == "polling")
    header[QUEUED] = int(queued)
    header[2 : 2 + len(fields)] = torch.tensor(list(fields), dtype=torch.int64)
    header[-2], header[-1] = fingerprint, fingerprint * fingerprint
    return header.to(control_device())


def _members(group: dist.ProcessGroup | None) -> int:
    return dist.get_world_size(group) if group is not None else size()


@contextlib.contextmanager
def own_checks(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run this rank's checks of its own arguments (before the round): when one raises ValueError, the round's
    header tells the other ranks, which raise HorovodInternalError, before it is re-raised here. Raising on this
    rank alone would leave the others waiting in (or pairing with this rank's next call) a collective that this
    rank never runs. With TRAINMESH_HOROVOD_CHECK=0 only a DistributedOptimizer step's header goes unawaited, and
    an optimizer's step raises nothing here."""
    try:
        yield
    except ValueError:
        if _members(group) > 1:
            flush(group)  # this rank's deferred collectives first: the others may be waiting in them
            dist.all_reduce(_header(Kind.OTHER, 0, failed=True), group=group)
        raise


def start_round(
    kind: Kind, call: Call, fields: Sequence[int] = (), group: dist.ProcessGroup | None = None, role: Role = Role.PLAIN
) -> Round:
    """Send this active rank's header (`call`: what it is about to run, for the ranks' agreement), after the group's
    deferred collectives (but a barrier's). With the check on, wait for the sum and raise HorovodInternalError on
    every rank when the ranks disagree (or a rank's own checks failed: own_checks); OTHER rounds also wait, and raise
    RankJoinedError when a rank has joined. A DEFERRABLE round that meets the others in a barrier raises Deferred.
    Otherwise the header may still be in flight. `group`: a process set's (hvd.join() answers only the global set's
    rounds)."""
    members = _members(group)
    if members == 1:
        return Round()
    if role != Role.BARRIER and not flush(group) and role == Role.DEFERRABLE:
        raise Deferred  # behind a deferred collective: call order is kept
    asking = _asking.get(group, "") if role == Role.DEFERRABLE else ""
    while True:  # a barrier's round goes again while other ranks' async calls defer
        queued = role == Role.BARRIER and bool(_deferred.get(group))
        fingerprint = call.fingerprint() if checks_collectives() else 0
        header = _header(kind, fingerprint, fields, role=role, asking=asking, queued=queued)
        if kind != Kind.OTHER and role == Role.PLAIN and not checks_collectives():
            return Round(header, dist.all_reduce(header, async_op=True, group=group), members)
        dist.all_reduce(header, group=group)
        active, *_, failed, barriers, deferrable, blocked, polling, queues, total, squares = header.tolist()
        if failed:  # checked first: the failed ranks sent no fingerprint
            raise HorovodInternalError(
                f"{call.what}: the arguments were refused on {failed} of {members} ranks (their ValueError says "
                "why), so none ran"
            )
        if not (0 < barriers < active and barriers + deferrable == active):
            break
        # Only when every barrier rank has deferred calls of its own can they be what the others wait for
        if blocked == deferrable and queues < barriers:  # the async ranks all wait: none can go on
            raise HorovodInternalError(
                f"{call.what}: {barriers} of {members} ranks wait in hvd.barrier() while the others wait for an "
                "async collective (synchronize) that the barrier's ranks have not called, so no rank can go on "
                "(Horovod would hang here). Fix: call the collective on every rank before the barrier, or the "
                "barrier after synchronize() on every rank."
            )
        if role == Role.DEFERRABLE:
            raise Deferred
        if (blocked or polling) and queues == barriers:  # a barrier's rank: the others wait for or poll a call
            flush(group)
    if not agreed(active, total, squares):
        raise refuse(call, group)
    if kind == Kind.OTHER and active < members:
        raise RankJoinedError(
            f"{call.what}: {members - active} of {members} ranks have called hvd.join(), and a joined rank can only "
            "take part in all-reduces (hvd.allreduce, DistributedOptimizer steps), as under Horovod. Fix: call it "
            "after hvd.join() has returned on every rank."
        )
    return Round(header, None, members)


def join(device: int = -1) -> int:
    """Horovod's hvd.join(): this rank has no more data. Until every rank has called it, take part in the
    others' all-reduces with zeros. Returns the rank that joined last (the highest one, when several joined
    in the same round): its model has seen every step, so `hvd.broadcast_parameters(model.state_dict(),
    root_rank=hvd.join())` gives every rank the final weights. `device` is accepted for Horovod's signature."""
    if size() == 1:
        return 0
    while not flush(None, "waiting"):  # this rank's deferred collectives first: the others wait in them
        time.sleep(0.01)
    sat_out = 0  # rounds this rank answered while joined; 0 for the ranks that joined last
    where = control_device()
    while True:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=where)
        dist.all_reduce(header)
        active = int(header[0])
        if active == 0:
            break
        sat_out += 1
        values = header.tolist()
        if values[FAILED]:  # an active rank's own checks failed: no collective follows
            continue
        if 0 < values[BARRIERS] < active and values[BARRIERS] + values[DEFERRABLE] == active:
            continue  # async calls meeting a barrier: they defer, the barrier's ranks send theirs again (or raise)
        if not agreed(active, values[-2], values[-1]):
            each_rank(None)  # the active ranks disagree: tell them this rank is joined; they raise
            continue
        kind, *fields = (int(v) // active for v in values[FIELDS])
        if kind == Kind.ALLREDUCE:
            _answer_allreduce(ReduceOp(fields[0]), DTYPES[fields[1]], fields[2], fields[3])
        elif kind == Kind.OPTIMIZER:
            shadow = _shadows[fields[0]]() if fields[0] < len(_shadows) else None
            if shadow is None:
                raise RuntimeError(
                    f"hvd.join(): the other ranks are stepping DistributedOptimizer #{fields[0]}, which this rank "
                    "does not have (any more). Fix: create the same DistributedOptimizers on every rank and keep "
                    "them until hvd.join() returns."
                )
            shadow()
        # Kind.OTHER: the active ranks raise RankJoinedError; nothing to answer
    last = torch.tensor([rank() if sat_out == 0 else -1], dtype=torch.int64, device=where)
    dist.all_reduce(last, op=dist.ReduceOp.MAX)
    return int(last.item())


def _answer_allreduce(op: ReduceOp, dtype: torch.dtype, numel: int, device_code: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if device_code else torch.device("cpu")
    dist.all_reduce(identity(op, dtype, (numel,), device), op=TORCH_OPS[op])


def identity(op: ReduceOp, dtype: torch.dtype, shape: Sequence[int], device: torch.device) -> torch.Tensor:
    """What a joined rank contributes: the value that leaves the others' reduction unchanged (Average, as
    Horovod's, still divides by hvd.size())."""
    if op in (ReduceOp.Min, ReduceOp.Max):
        if dtype.is_floating_point:
            low, high = float("-inf"), float("inf")
        else:
            low, high = torch.iinfo(dtype).min, torch.iinfo(dtype).max
        return torch.full(tuple(shape), high if op == ReduceOp.Min else low, dtype=dtype, device=device)
    if op == ReduceOp.Product:
        return torch.ones(tuple(shape), dtype=dtype, device=device)
    return torch.zeros(tuple(shape), dtype=dtype, device=device)
