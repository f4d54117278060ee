"""Horovod's allgather (and its grouped form) and broadcast on torch.distributed, with Horovod's gradients.

Details: docs/internals.md#compathorovodopspy
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.agreement import describe
from trainmesh.compat.horovod.basics import ReduceOp, rank
from trainmesh.compat.horovod.handles import Handle, group_handle, launch, synchronize
from trainmesh.compat.horovod.ops import (
    allreduce_async,
    check,
    check_contiguous,
    copy_back,
    on_wire,
    part_names,
)
from trainmesh.compat.horovod.process_sets import ProcessSet, resolve
from trainmesh.compat.horovod.rounds import Kind, Role, own_checks, start_round


def first_dims(tensor: torch.Tensor, ps: ProcessSet) -> list[int]:
    """Every member's size of dimension 0, in set-rank order (one small all-gather)."""
    mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    if ps.size() == 1:
        return [tensor.shape[0]]
    sizes = [torch.empty_like(mine) for _ in range(ps.size())]
    dist.all_gather(sizes, mine, group=ps.group)
    return [int(s.item()) for s in sizes]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> Handle[torch.Tensor]:
    """Start concatenating every member's `tensor` along dimension 0; the first dimension may differ between
    ranks, the others (and the dtype) may not. The sizes are exchanged first (blocking), then the tensors,
    padded to the largest, are gathered asynchronously."""
    return allgather_with_sizes(tensor, name, process_set)[0]


def allgather_with_sizes(
    tensor: torch.Tensor, name: str | None, process_set: object
) -> tuple[Handle[torch.Tensor], list[int]]:
    """allgather_async, and how many rows each member gave (filled in once the collective has started)."""
    ps = check("hvd.allgather", process_set)
    with own_checks(ps.group):
        check_contiguous("hvd.allgather", tensor)
        if tensor.dim() == 0:
            raise ValueError("hvd.allgather: a scalar; it is concatenated along dimension 0. Fix: tensor.reshape(1)")
    call = describe("hvd.allgather", tensor, name, any_first_dim=True)
    sizes: list[int] = []

    def start() -> Handle[torch.Tensor]:
        start_round(Kind.OTHER, call, group=ps.group, role=Role.DEFERRABLE)
        sizes.extend(first_dims(tensor, ps))
        longest = max(sizes)
        padded = on_wire(tensor.detach())
        if tensor.shape[0] < longest:
            padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))])
        parts = [torch.empty_like(padded) for _ in range(ps.size())]
        work = dist.all_gather(parts, padded, group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            return torch.cat([part[:count] for part, count in zip(parts, sizes, strict=True)]).to(tensor.dtype)

        return Handle([work], finish)

    return launch("allgather", name, ps.group, start), sizes


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """Every member's `tensor` concatenated along dimension 0 (sizes may differ); differentiable."""
    return _Allgather.apply(tensor, name, check("hvd.allgather", process_set))


class _Allgather(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients averaged over the members, this rank's rows of the result."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: str | None, ps: ProcessSet) -> torch.Tensor:
        handle, sizes = allgather_with_sizes(tensor.contiguous(), name, ps)
        ctx.sizes, ctx.ps = sizes, ps
        return synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.ps))
        offset = sum(ctx.sizes[: ctx.ps.rank()])
        return averaged.narrow(0, offset, ctx.sizes[ctx.ps.rank()]), None, None


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: object = None
) -> Handle[list[torch.Tensor]]:
    """allgather_async for each tensor, one handle for all."""
    names = part_names(name, len(tensors))
    return group_handle([allgather_async(t, n, process_set) for t, n in zip(tensors, names, strict=True)])


def grouped_allgather(
    tensors: Sequence[torch.Tensor], name: str | None = None, process_set: object = None
) -> list[torch.Tensor]:
    """hvd.allgather for each tensor (differentiable)."""
    return [allgather(t, n, process_set) for t, n in zip(tensors, part_names(name, len(tensors)), strict=True)]


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle[torch.Tensor]:
    """Start overwriting `tensor` with root_rank's on every member (root_rank: a global rank, as Horovod's)."""
    ps = check("hvd.broadcast", process_set)
    with own_checks(ps.group):
        check_contiguous("hvd.broadcast", tensor)
        check_root(root_rank, ps, "hvd.broadcast")
    call = describe("hvd.broadcast", tensor, name, root=root_rank)

    def start() -> Handle[torch.Tensor]:
        start_round(Kind.OTHER, call, group=ps.group, role=Role.DEFERRABLE)
        buffer = on_wire(tensor.detach())
        work = broadcast_work(buffer, root_rank, ps)
        return Handle([work], lambda: copy_back(tensor, buffer))

    return launch("broadcast", name, ps.group, start)


def broadcast_work(tensor: torch.Tensor, root_rank: int, ps: ProcessSet | None = None) -> dist.Work | None:
    """The broadcast itself, within a round the caller has started (broadcast_parameters: one for many)."""
    group = ps.group if ps is not None else None
    if (ps.size() if ps is not None else dist.get_world_size()) == 1:
        return None
    return dist.broadcast(tensor.detach(), src=root_rank, group=group, async_op=True)


def check_root(root_rank: int, ps: ProcessSet, what: str) -> None:
    members = ps.ranks if ps.ranks is not None else list(range(ps.size()))
    if root_rank not in members:
        raise ValueError(f"{what}: root_rank={root_rank}, but the ranks are {_span(members)}")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if ranks == list(range(ranks[0], ranks[-1] + 1)) else str(ranks)


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle[torch.Tensor]:
    """broadcast_async_ on a copy: `tensor` is left as it is."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """root_rank's `tensor` on every member (a copy; the input is left as it is); differentiable."""
    return _Broadcast.apply(tensor, root_rank, name, resolve(process_set, "hvd.broadcast"))


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients averaged over the members, on the root; zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int, name: str | None, ps: ProcessSet) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, ps
        return synchronize(broadcast_async(tensor, root_rank, name, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        averaged = synchronize(allreduce_async(grad.contiguous(), op=ReduceOp.Average, process_set=ctx.ps))
        return (averaged if rank() == ctx.root_rank else torch.zeros_like(averaged)), None, None, None
