"""`Collectives`: who this process is in the job, and the collectives a loop and the engine share.

`Runtime` is one (rank, world size, all_reduce, barrier, on_main, ...); each call works the same without a
process group or with one process, so a script runs unchanged at any scale.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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
    """An all-reduce in flight; `result()` waits once and returns the reduced numbers, `carried()` the reduced
    values of the tensor that rode along (see `Collectives.all_reduce_async`)."""

    def __init__(
        self,
        tensor: torch.Tensor | None,
        work: Any,
        divisor: int,
        count: int,
        carry: torch.Tensor | None = None,
        values: list[float] | None = None,
    ) -> None:
        self._tensor, self._work, self._divisor, self._count = tensor, work, divisor, count
        self._carry = carry  # one rank: not reduced, read only when asked for (a device sync on a GPU)
        self._values = values  # one rank: the numbers as given, never a tensor to read back

    def result(self) -> list[float]:
        return self._reduced()[: self._count]

    def carried(self) -> list[float]:
        return read_carried([self])[0]

    def _reduced(self) -> list[float]:
        if self._values is None:
            assert self._tensor is not None
            if self._work is not None:
                self._work.wait()
            self._values = [float(v) / self._divisor for v in self._tensor.tolist()]
        return self._values


def read_carried(reduces: list[PendingReduce]) -> list[list[float]]:
    """`carried()` of each of `reduces`, with one read of the device for all the carries that one rank kept
    unreduced (the reduced ones are read with their results)."""
    local = [r._carry.detach().reshape(-1) for r in reduces if r._carry is not None]
    values = torch.cat(local).to(torch.float64).tolist() if local else []
    out = []
    for r in reduces:
        if r._carry is None:
            out.append(r._reduced()[r._count :])
        else:
            size = r._carry.numel()
            out.append([v / r._divisor for v in values[:size]])
            values = values[size:]
    return out


class Collectives:
    """This process's place in the job (`env`) and collectives over all its ranks, on `device`'s tensors."""

    def __init__(self, env: DistEnv, device: torch.device) -> None:
        self.env = env
        self.device = device

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

    def all_reduce_async(
        self, values: list[float], op: ReduceOp = "sum", carry: torch.Tensor | None = None
    ) -> PendingReduce:
        """Start reducing numbers over all ranks; `.result()` waits for them (overlap it with compute). `carry`:
        a tensor of numbers (on this rank's device) reduced in the same collective, read by `.carried()`: values
        that would otherwise need a collective of their own (the loop's logged loss and step times)."""
        if not (self._has_group and self.world_size > 1):  # nothing to reduce: no trip through the device,
            return PendingReduce(None, None, 1, len(values), carry, [float(v) for v in values])  # nor read-back
        dtype = torch.float64 if self.device.type == "cpu" else torch.float32
        tensor = torch.tensor(values, dtype=torch.float64).to(self.device, dtype)
        if carry is not None:
            tensor = torch.cat([tensor, carry.detach().reshape(-1).to(dtype)])
        work = dist.all_reduce(tensor, op=_OPS[op], async_op=True)
        return PendingReduce(tensor, work, self.world_size if op == "mean" else 1, len(values))

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
        return dist.new_group(backend="gloo") if self._has_group else None

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
