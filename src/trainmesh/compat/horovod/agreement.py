"""The ranks agree on each collective before it starts, as Horovod's coordinator makes them: each rank puts a
fingerprint of what it is about to run (the call, name, operation, dtype, shape, root rank, device) into the round's
header all-reduce (rounds.py); when the fingerprints differ, every rank raises HorovodInternalError naming each
rank's call. Without the check, torch.distributed returns a wrong result (dtypes that differ), aborts a rank (an
all-reduce's sizes) or hangs (two roots).

Cost: the header all-reduce, which hvd.join() needs anyway, is waited for before the collective starts: one small
round trip (15 integers) per call, per DistributedOptimizer step (not per gradient). TRAINMESH_HOROVOD_CHECK=0 in
the environment of hvd.init() turns the check off: no fingerprint is compared, and a DistributedOptimizer step's
header goes without waiting (every other call still waits for its header: an all-reduce may be deferred behind a
barrier, and the other collectives raise when a rank has joined).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.errors import HorovodInternalError

FINGERPRINT_BITS = 24  # a square of it, summed over 2**15 ranks, still fits the header's int64


@dataclass(frozen=True)
class Call:
    """What one rank is about to run. `shape` holds the dimensions the ranks must agree on (allgather: all but the
    first, which is written '*')."""

    what: str
    name: str | None = None
    op: str = ""
    dtype: str = ""
    shape: tuple[int | str, ...] = ()
    root: int | None = None
    device: str = ""

    def fingerprint(self) -> int:
        """A stable number (Python's hash() of a string differs between processes)."""
        return zlib.crc32(repr(self).encode()) & ((1 << FINGERPRINT_BITS) - 1)

    def __str__(self) -> str:
        shape = "(" + ", ".join(map(str, self.shape)) + ("," if len(self.shape) == 1 else "") + ")"
        parts = [
            f"name={self.name!r}" if self.name is not None else "",
            f"op={self.op}" if self.op else "",
            f"dtype={self.dtype}" if self.dtype else "",
            f"shape={shape}" if self.dtype else "",
            f"root_rank={self.root}" if self.root is not None else "",
            f"device={self.device}" if self.device else "",
        ]
        return f"{self.what}({', '.join(p for p in parts if p)})"


def describe(
    what: str,
    tensor: torch.Tensor,
    name: str | None,
    op: str = "",
    root: int | None = None,
    any_first_dim: bool = False,
) -> Call:
    """A Call for `tensor` (its dtype, shape and device type); `any_first_dim`: the ranks' first dimensions may
    differ (allgather, alltoall)."""
    shape: tuple[int | str, ...] = ("*", *tensor.shape[1:]) if any_first_dim else tuple(tensor.shape)
    dtype = str(tensor.dtype).removeprefix("torch.")
    return Call(what, name, op, dtype, shape, root, tensor.device.type)


def agreed(active: int, total: int, squares: int) -> bool:
    """Whether the `active` ranks sent the same fingerprint, from its sum and the sum of its squares: equal values
    are the only ones for which active * sum(f**2) == sum(f)**2 (Cauchy-Schwarz)."""
    return active * squares == total * total


def each_rank(mine: Call | None, group: dist.ProcessGroup | None = None) -> list[Call | None]:
    """Every rank's call (None from a rank inside hvd.join()), once the fingerprints have disagreed."""
    calls: list[Call | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(calls, mine, group=group)
    return calls


def refuse(mine: Call, group: dist.ProcessGroup | None = None) -> HorovodInternalError:
    """The error every rank raises when the ranks disagree on `mine`'s collective."""
    calls = each_rank(mine, group)
    lines = "\n".join(
        f"  rank {r}: {call if call is not None else 'inside hvd.join()'}" for r, call in enumerate(calls)
    )
    return HorovodInternalError(
        f"{mine.what}: the ranks called different collectives, so none ran (rank in this group: call):\n{lines}\n"
        "Every rank must issue the same collectives in the same order, with the same name, operation, dtype, "
        "root rank and shape (allgather and alltoall: all but the first dimension). Fix: make the differing "
        "rank's call match the others'."
    )
