"""Horovod's all-reduces (hvd.allreduce, its async, in-place and grouped forms) and barrier on
torch.distributed; ranks are matched by call order, and agree on each call before it runs (agreement.py).

Details: docs/internals.md#compathorovodopspy
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.agreement import Call, describe
from trainmesh.compat.horovod.basics import ReduceOp
from trainmesh.compat.horovod.compression import Compression, Compressor
from trainmesh.compat.horovod.handles import Handle, group_handle, launch, synchronize
from trainmesh.compat.horovod.process_sets import ProcessSet, resolve
from trainmesh.compat.horovod.rounds import TORCH_OPS, Kind, Role, dtype_code, own_checks, start_round


def check(what: str, process_set: object) -> ProcessSet:
    """The process set to run on (this rank must be a member)."""
    return resolve(process_set, what)


def check_contiguous(what: str, tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"{what}: the tensor must be contiguous (Horovod's rule too). Fix: pass tensor.contiguous()")


def resolve_op(op: int | None, average: bool | None, what: str) -> ReduceOp:
    """Horovod's rules: `op` wins, `average` is its deprecated spelling, the default is Average."""
    if op is not None and average is not None:
        raise ValueError(f"{what}: the op parameter supersedes average. Please provide only one of them.")
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op`", DeprecationWarning, stacklevel=3)
        return ReduceOp.Average if average else ReduceOp.Sum
    resolved = ReduceOp.Average if op is None else ReduceOp(op)
    if resolved == ReduceOp.Adasum:
        raise NotImplementedError(
            f"{what}(op=hvd.Adasum): Adasum is not supported by trainmesh.compat.horovod (torch.distributed has no "
            "Adasum reduction). Allowed: hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product. Fix: op=hvd.Average, "
            "with the learning rate scaled by hvd.size() as Horovod's examples do for Average."
        )
    return resolved


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype == torch.int16 else dtype


def on_wire(tensor: torch.Tensor) -> torch.Tensor:
    """What travels: gloo and NCCL have no int16 ("Invalid scalar type"), so int16 goes as an int32 copy (exact;
    a sum or product cast back wraps as it would in int16). Anything else is the tensor itself."""
    return tensor.to(wire_dtype(tensor.dtype))


def scale_(tensor: torch.Tensor, factor: float, divisor: int = 1) -> torch.Tensor:
    """tensor *= factor / divisor as Horovod scales: integers in float64, then cast back (truncation toward zero);
    float16 and bfloat16 in float32 (Horovod's CPU arithmetic for half precision). Integers are multiplied, then
    divided: an exact multiple of `divisor` stays exact (49 * (1 / 49) is 0.999..., which truncates to 0)."""
    if factor == 1.0 and divisor == 1:
        return tensor
    if tensor.is_floating_point() and tensor.element_size() == 2:
        return tensor.copy_(tensor.float() * factor / divisor)
    if tensor.is_floating_point() or tensor.is_complex():
        return tensor.mul_(factor / divisor)
    return tensor.copy_(tensor.double() * factor / divisor)


def copy_back(tensor: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """Write `result` into `tensor` (an in-place call's input) unless it is there already. Under no_grad: the
    input may be a leaf that requires grad (a parameter), which Horovod's in-place calls overwrite too."""
    if result.data_ptr() != tensor.data_ptr() or result.dtype != tensor.dtype:
        with torch.no_grad():
            tensor.copy_(result)
    return tensor


def finish_reduction(tensor: torch.Tensor, op: ReduceOp, members: int, postscale: float) -> torch.Tensor:
    """Average's division and the postscale factor, on the sum in `tensor`. Integers: one scaling by
    postscale / members in float64, as Horovod's, so an average truncates toward zero ([-3, 1] -> -1)."""
    average = op == ReduceOp.Average
    if tensor.is_floating_point() or tensor.is_complex():
        if average:
            tensor.div_(members)
        return scale_(tensor, postscale)
    return scale_(tensor, postscale, members if average else 1)


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle[torch.Tensor]:
    """Start reducing `tensor` in place over the process set's ranks (all by default; Average by default: the sum
    divided by their number, truncated toward zero for integer tensors, as Horovod's)."""
    reduce_op = resolve_op(op, average, "hvd.allreduce")
    ps = check("hvd.allreduce", process_set)
    with own_checks(ps.group):
        check_contiguous("hvd.allreduce", tensor)
        wire_code = dtype_code(wire_dtype(tensor.dtype))  # what a rank inside hvd.join() sends back
    fields = (int(reduce_op), wire_code, tensor.numel(), int(tensor.device.type == "cuda"))
    call = describe("hvd.allreduce", tensor, name, op=reduce_op.name)

    def start() -> Handle[torch.Tensor]:
        header = start_round(Kind.ALLREDUCE, call, fields, ps.group, Role.DEFERRABLE)
        # detached: the input may be a parameter (a leaf that requires grad), which autograd forbids changing in place
        buffer = on_wire(scale_(tensor.detach(), prescale_factor))
        work = dist.all_reduce(buffer, op=TORCH_OPS[reduce_op], group=ps.group, async_op=True)

        def finish() -> torch.Tensor:
            return copy_back(tensor, finish_reduction(buffer, reduce_op, ps.size(), postscale_factor))

        return Handle([header.work, work], finish)

    return launch("allreduce", name, ps.group, start)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle[torch.Tensor]:
    """allreduce_async_ on a copy: `tensor` is left as it is."""
    copy = tensor.detach().clone(memory_format=torch.contiguous_format)
    return allreduce_async_(copy, average, name, op, prescale_factor, postscale_factor, process_set)


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> torch.Tensor:
    """The reduced copy of `tensor` (which is left as it is); differentiable."""
    reduce_op = resolve_op(op, average, "hvd.allreduce")
    ps = check("hvd.allreduce", process_set)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, reduce_op, name, prescale_factor, postscale_factor, ps)
    return compression.decompress(reduced, ctx)


class _Allreduce(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients reduced with the same op."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float, ps: ProcessSet
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post, ctx.ps = op, pre, post, ps
        return synchronize(allreduce_async(tensor, None, name, op, pre, post, ps))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = synchronize(allreduce_async(grad, None, None, ctx.op, ctx.pre, ctx.post, ctx.ps))
        return reduced, None, None, None, None, None


def part_names(name: str | None, count: int) -> list[str | None]:
    """The names of a grouped call's parts (Horovod: name.0, name.1, ...)."""
    return [None if name is None else f"{name}.{i}" for i in range(count)]


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle[list[torch.Tensor]]:
    """allreduce_async_ for each tensor, one handle for all (one collective each: no fusion)."""
    handles = [
        allreduce_async_(t, average, n, op, prescale_factor, postscale_factor, process_set)
        for t, n in zip(tensors, part_names(name, len(tensors)), strict=True)
    ]
    return group_handle(handles)


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle[list[torch.Tensor]]:
    copies = [t.detach().clone(memory_format=torch.contiguous_format) for t in tensors]
    return grouped_allreduce_async_(copies, average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> list[torch.Tensor]:
    handle = grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    return synchronize(handle)


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> list[torch.Tensor]:
    """hvd.allreduce for each tensor (differentiable; one collective each)."""
    return [
        allreduce(t, average, n, compression, op, prescale_factor, postscale_factor, process_set)
        for t, n in zip(tensors, part_names(name, len(tensors)), strict=True)
    ]


def barrier(process_set: object = None) -> None:
    """Wait until every rank of the process set has reached this call."""
    ps = check("hvd.barrier", process_set)
    # waits for every rank's header: a barrier (not for this rank's deferred collectives, as Horovod's)
    start_round(Kind.OTHER, Call("hvd.barrier"), group=ps.group, role=Role.BARRIER)
