"""Horovod's alltoall, reducescatter (and its grouped form) and sparse_allreduce_async on torch.distributed,
with Horovod's gradients.

Details: docs/internals.md#compathorovodopspy
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.agreement import describe
from trainmesh.compat.horovod.basics import ReduceOp
from trainmesh.compat.horovod.compression import Compression, Compressor
from trainmesh.compat.horovod.gather import allgather, allgather_async
from trainmesh.compat.horovod.handles import Handle, group_handle, launch, synchronize
from trainmesh.compat.horovod.ops import (
    check,
    check_contiguous,
    finish_reduction,
    on_wire,
    part_names,
    resolve_op,
    scale_,
)
from trainmesh.compat.horovod.process_sets import ProcessSet
from trainmesh.compat.horovod.rounds import TORCH_OPS, Kind, Role, own_checks, start_round


def _send_counts(tensor: torch.Tensor, splits: torch.Tensor | Sequence[int] | None, members: int) -> list[int]:
    """How many rows of `tensor` go to each member, checked as Horovod checks them."""
    if tensor.dim() == 0:
        raise ValueError("hvd.alltoall: a scalar; it is split along dimension 0. Fix: tensor.reshape(1)")
    if splits is None:
        if tensor.shape[0] % members:
            raise ValueError(
                f"hvd.alltoall: dimension 0 ({tensor.shape[0]}) is not a multiple of the {members} ranks. Fix: "
                "pass splits= (how many rows go to each rank)"
            )
        return [tensor.shape[0] // members] * members
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(f"hvd.alltoall: splits must be an int32 tensor (Horovod's rule), not {splits.dtype}")
        splits = [int(s) for s in splits.tolist()]
    counts = list(splits)
    if len(counts) != members or min(counts) < 0:
        raise ValueError(f"hvd.alltoall: splits={counts}; give {members} counts (one per rank), none negative")
    if sum(counts) > tensor.shape[0]:
        raise ValueError(f"hvd.alltoall: splits={counts} sum to more than dimension 0 ({tensor.shape[0]})")
    return counts


def alltoall_async(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: object = None,
) -> Handle[tuple[torch.Tensor, torch.Tensor]]:
    """Start sending splits[i] rows of `tensor` (along dimension 0, in order) to member i; the result is what every
    member sent this one, concatenated in rank order, and how many rows came from each (int32)."""
    ps = check("hvd.alltoall", process_set)
    with own_checks(ps.group):
        check_contiguous("hvd.alltoall", tensor)
        send = _send_counts(tensor, splits, ps.size())
    call = describe("hvd.alltoall", tensor, name, any_first_dim=True)

    def start() -> Handle[tuple[torch.Tensor, torch.Tensor]]:
        start_round(Kind.OTHER, call, group=ps.group, role=Role.DEFERRABLE)
        wire = on_wire(tensor.detach()[: sum(send)])
        if ps.size() == 1:
            return Handle([], lambda: (wire.clone().to(tensor.dtype), torch.tensor(send, dtype=torch.int32)))
        sent = torch.tensor(send, dtype=torch.int64, device=tensor.device)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=ps.group)  # each member learns what it will receive
        recv = [int(r) for r in received.tolist()]
        out = wire.new_empty((sum(recv), *tensor.shape[1:]))
        work = dist.all_to_all_single(out, wire, recv, send, group=ps.group, async_op=True)
        return Handle([work], lambda: (out.to(tensor.dtype), torch.tensor(recv, dtype=torch.int32)))

    return launch("alltoall", name, ps.group, start)


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | Sequence[int] | None = None,
    name: str | None = None,
    process_set: object = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What every member sent this one (differentiable); with `splits`, also how many rows came from each."""
    ps = check("hvd.alltoall", process_set)
    collected, received = _Alltoall.apply(tensor, splits, name, ps)
    return collected if splits is None else (collected, received)


class _Alltoall(torch.autograd.Function):
    """Horovod's gradient: the incoming gradient sent back where its rows came from."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, ps: ProcessSet) -> Any:
        collected, received = synchronize(alltoall_async(tensor, splits, name, ps))
        ctx.received, ctx.ps, ctx.rows = received, ps, tensor.shape[0]
        ctx.mark_non_differentiable(received)
        return collected, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _: Any) -> tuple[torch.Tensor | None, None, None, None]:
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received, None, ctx.ps))
        if back.shape[0] < ctx.rows:  # rows beyond sum(splits) were not sent: no gradient
            back = torch.cat([back, back.new_zeros((ctx.rows - back.shape[0], *back.shape[1:]))])
        return back, None, None, None


def _my_rows(rows: int, ps: ProcessSet) -> tuple[int, int]:
    """(first row, count) of this member's part: Horovod gives the first rows % n members one row more."""
    n, me = ps.size(), ps.rank()
    base, extra = divmod(rows, n)
    return me * base + min(me, extra), base + (1 if me < extra else 0)


def reducescatter_async(
    tensor: torch.Tensor,
    name: str | None = None,
    op: int = ReduceOp.Average,
    process_set: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle[torch.Tensor]:
    """Start reducing `tensor` over the members; each gets its part of dimension 0 (the first rows % n members one
    row more). Runs as an all-reduce followed by a slice: twice a reduce-scatter's traffic, but every op, dtype
    and uneven split works on gloo."""
    reduce_op = resolve_op(op, None, "hvd.reducescatter")
    ps = check("hvd.reducescatter", process_set)
    with own_checks(ps.group):
        check_contiguous("hvd.reducescatter", tensor)
        if tensor.dim() == 0:
            raise ValueError("hvd.reducescatter: a scalar; it is split along dimension 0. Fix: tensor.reshape(1)")
    call = describe("hvd.reducescatter", tensor, name, op=reduce_op.name)

    def start() -> Handle[torch.Tensor]:
        start_round(Kind.OTHER, call, group=ps.group, role=Role.DEFERRABLE)
        buffer = on_wire(scale_(tensor.detach().clone(), prescale_factor))
        work = dist.all_reduce(buffer, op=TORCH_OPS[reduce_op], group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            first, count = _my_rows(tensor.shape[0], ps)
            mine = finish_reduction(buffer.narrow(0, first, count).clone(), reduce_op, ps.size(), postscale_factor)
            return mine.to(tensor.dtype)

        return Handle([work], finish)

    return launch("reducescatter", name, ps.group, start)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = ReduceOp.Average,
    process_set: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """This member's part of the reduced `tensor`; differentiable."""
    reduce_op = resolve_op(op, None, "hvd.reducescatter")
    ps = check("hvd.reducescatter", process_set)
    compressed, ctx = compression.compress(tensor)
    part = _Reducescatter.apply(compressed, name, reduce_op, ps, prescale_factor, postscale_factor)
    return compression.decompress(part, ctx)


class _Reducescatter(torch.autograd.Function):
    """Horovod's gradient: the members' incoming gradients gathered (times n for Sum, and the scale factors)."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: str | None, op: ReduceOp, ps: ProcessSet, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.ps, ctx.factor = op, ps, pre * post
        return synchronize(reducescatter_async(tensor, name, op, ps, pre, post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        factor = ctx.factor * (ctx.ps.size() if ctx.op == ReduceOp.Sum else 1)
        return allgather(grad * factor, process_set=ctx.ps), None, None, None, None, None


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    op: int = ReduceOp.Average,
    process_set: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> Handle[list[torch.Tensor]]:
    """reducescatter_async for each tensor, one handle for all."""
    handles = [
        reducescatter_async(t, n, op, process_set, prescale_factor, postscale_factor)
        for t, n in zip(tensors, part_names(name, len(tensors)), strict=True)
    ]
    return group_handle(handles)


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int = ReduceOp.Average,
    process_set: object = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list[torch.Tensor]:
    """hvd.reducescatter for each tensor (differentiable)."""
    return [
        reducescatter(t, n, compression, op, process_set, prescale_factor, postscale_factor)
        for t, n in zip(tensors, part_names(name, len(tensors)), strict=True)
    ]


def sparse_allreduce_async(
    tensor: torch.Tensor, name: str | None = None, op: int = ReduceOp.Average, process_set: object = None
) -> Callable[[], torch.Tensor]:
    """Horovod's sparse all-reduce: every member's indices and values gathered (not summed: duplicates add up when
    the result is coalesced or made dense). Returns a function that waits and gives the sparse result, as
    Horovod's does."""
    reduce_op = resolve_op(op, None, "hvd.sparse_allreduce_async")
    if reduce_op not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"hvd.sparse_allreduce_async(op={reduce_op.name}): allowed: hvd.Average, hvd.Sum")
    ps = check("hvd.sparse_allreduce_async", process_set)
    sparse = tensor.coalesce() if not tensor.is_coalesced() else tensor
    indices = allgather_async(sparse.indices().t().contiguous(), f"{name}.indices" if name else None, ps)
    values = allgather_async(sparse.values().contiguous(), f"{name}.values" if name else None, ps)

    def wait() -> torch.Tensor:
        gathered = synchronize(values)
        if reduce_op == ReduceOp.Average:
            gathered = gathered / ps.size()
        return torch.sparse_coo_tensor(synchronize(indices).t(), gathered, tuple(tensor.shape))

    return wait
