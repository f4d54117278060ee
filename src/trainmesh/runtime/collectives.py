"""`Collectives`: who this process is in the job, and the collectives a loop and the engine share.

`Runtime` is one (rank, world size, all_reduce, barrier, on_main, ...); each call works the same without a
process group or with one process, so a script runs unchanged at any scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

from trainmesh.core.env import DistEnv
from trainmesh.core.errors import UserError

T = TypeVar("T")
ReduceOp = Literal["sum", "mean", "max", "min"]
_OPS = {
    "sum": dist.ReduceOp.SUM,
    "mean": dist.ReduceOp.SUM,  # divided by the world size afterwards (gloo has no AVG)
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


class PendingReduce:
    """Integers of the host summed over ranks, in flight: `result()` waits for them (CPU tensors on a CPU group:
    reading them never waits for a device); and a tensor of the device summed alongside, read by `carried()` when
    asked for (a device sync on a GPU). See `Collectives.all_reduce_async`."""

    def __init__(
        self,
        counts: torch.Tensor | None,
        work: Any,
        carry: torch.Tensor | None = None,
        carry_work: Any = None,
        values: list[int] | None = None,
    ) -> None:
        self._counts, self._work, self._carry, self._carry_work = counts, work, carry, carry_work
        self._values = values  # one rank: the integers as given

    def result(self) -> list[int]:
        if self._values is None:
            assert self._counts is not None
            self._work.wait()
            self._values = [int(v) for v in self._counts.tolist()]
        return self._values

    def carried(self) -> list[float]:
        """The carried tensor summed over ranks, as numbers ([] when nothing rode along)."""
        if self._carry is None:
            return []
        if self._carry_work is not None:
            self._carry_work.wait()
        return [float(v) for v in self._carry.tolist()]


class Collectives:
    """This process's place in the job (`env`) and collectives over all its ranks, on `device`'s tensors."""

    def __init__(self, env: DistEnv, device: torch.device, timeout_s: float | None = None) -> None:
        self.env = env
        self.device = device
        self._timeout = timedelta(seconds=timeout_s) if timeout_s else None  # of the groups made here (dist.timeout_s)
        self._gloo_group: dist.ProcessGroup | None = None  # for CPU tensors beside NCCL (`_host_group`)

    # -- who am I ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main_process(self) -> bool:
        return self.env.is_main

    @property
    def _has_group(self) -> bool:
        return dist.is_available() and dist.is_initialized()

    # -- numbers -----------------------------------------------------------------------------------
    def all_reduce(self, value: torch.Tensor | float, op: ReduceOp = "mean") -> torch.Tensor:
        """Reduce a metric over all ranks (a copy; the input is untouched)."""
        tensor = torch.as_tensor(value, dtype=torch.float64 if self.device.type == "cpu" else torch.float32)
        tensor = tensor.detach().clone().to(self.device)
        if self._has_group and self.world_size > 1:
            dist.all_reduce(tensor, op=_OPS[op])
            if op == "mean":
                tensor /= self.world_size
        return tensor

    def all_reduce_async(self, counts: list[int], carry: torch.Tensor | None = None) -> PendingReduce:
        """Start summing integers of the host (counts, votes) over all ranks; `.result()` waits for them (overlap it
        with compute). They travel as CPU tensors on a CPU (gloo) group, so reading them never waits for a device.
        `carry`: a tensor on this rank's device summed alongside, read by `.carried()` only when asked for (the
        loop's loss and phase times, once a logging window)."""
        if not (self._has_group and self.world_size > 1):  # nothing to reduce: no collective, no read-back
            return PendingReduce(None, None, carry, None, [int(v) for v in counts])
        tensor = torch.tensor(counts, dtype=torch.int64)
        work = dist.all_reduce(tensor, group=self._host_group(), async_op=True)
        if carry is None:
            return PendingReduce(tensor, work)
        summed = carry.detach().reshape(-1).clone()
        return PendingReduce(tensor, work, summed, dist.all_reduce(summed, async_op=True))

    def _host_group(self) -> dist.ProcessGroup | None:
        """The group for CPU tensors: the default one where it has a CPU backend (gloo, MPI, "cpu:gloo,cuda:nccl"),
        else a gloo group of all ranks beside NCCL, made once (collectively: every rank makes it at its first step's
        all-reduce). Its all-reduce is a few TCP messages a step: microseconds within a node, network round trips
        across nodes (not yet timed there)."""
        backend = str(dist.get_backend())
        if backend in ("gloo", "mpi") or "cpu:" in backend:
            return None
        if self._gloo_group is None:
            self._gloo_group = self.new_group()
        return self._gloo_group

    # -- objects and groups (`group`: another group of all ranks, e.g. a background thread's) --------
    def barrier(self, group: dist.ProcessGroup | None = None) -> None:
        if self._has_group:
            dist.barrier(group)

    def all_gather_object(self, obj: T, group: dist.ProcessGroup | None = None) -> list[T]:
        """Every rank's `obj`, in rank order (picklable objects)."""
        if not self._has_group or self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=group)
        return out

    def broadcast_object(self, obj: T, src: int = 0, group: dist.ProcessGroup | None = None) -> T:
        if not self._has_group or self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=group)
        return box[0]

    def new_group(self) -> dist.ProcessGroup | None:
        """Collective: a second gloo group of all ranks (None without a process group)."""
        if not self._has_group:
            return None
        return dist.new_group(backend="gloo", timeout=self._timeout)  # None: torch's default

    # -- one rank's work, every rank's outcome -----------------------------------------------------
    @contextlib.contextmanager
    def local_main_first(self) -> Iterator[None]:
        """Let local rank 0 of each node run the block first (e.g. build a cache), then the others. If it
        fails there, every rank raises (the others without running the block): a rank left waiting would
        otherwise see only its peer's death, with a traceback of its own."""
        first = self.local_rank == 0
        if not first:
            self._raise_if_any_failed(None)
        try:
            yield
        except Exception as e:
            if not first:
                raise
            self._raise_if_any_failed(e)
        if first:
            self._raise_if_any_failed(None)

    def on_main(self, fn: Callable[[], T]) -> T | None:
        """Collective: `fn()` on rank 0 only (it writes a run file, say) and its result there, None elsewhere.
        If it raises, every rank raises, instead of the others waiting for rank 0 in the next collective."""
        result, error = None, None
        if self.is_main_process:
            try:
                result = fn()
            except Exception as e:
                error = e
        self._raise_if_any_failed(error)
        return result

    def agreed(self, fn: Callable[[], T]) -> T:
        """Collective: `fn()` on every rank; if it raises on any rank, every rank raises."""
        result, error = None, None
        try:
            result = fn()
        except Exception as e:
            error = e
        self._raise_if_any_failed(error)
        return cast(T, result)

    def _raise_if_any_failed(self, error: Exception | None) -> None:
        """Collective: raise `error`, or the first other rank's failure (a UserError stays one)."""
        reports = self.all_gather_object(None if error is None else (isinstance(error, UserError), str(error)))
        for rank, report in enumerate(reports):
            if report is None:
                continue
            if error is not None:
                raise error
            is_user_error, message = report
            raise UserError(message) if is_user_error else RuntimeError(f"rank {rank} failed: {message}")
