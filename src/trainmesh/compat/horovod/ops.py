"""Horovod's collectives (hvd.allreduce, allgather, broadcast and their async and in-place forms) on torch.distributed;
ranks are matched by call order, not by `name`.

Details: docs/internals.md#compathorovodopspy
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.basics import ReduceOp, rank, size
from trainmesh.compat.horovod.compression import Compression, Compressor
from trainmesh.compat.horovod.rounds import DTYPES, TORCH_OPS, Kind, control_device, dtype_code, start_round

MAX_DIMS = 16  # allgather exchanges shapes in a fixed-size header


class Handle:
    """A collective in flight: pass it to hvd.poll() or hvd.synchronize()."""

    def __init__(self, works: Sequence[dist.Work | None], finish: Callable[[], torch.Tensor]) -> None:
        self._works = [w for w in works if w is not None]
        self._finish: Callable[[], torch.Tensor] | None = finish
        self._result: torch.Tensor | None = None

    def done(self) -> bool:
        return self._result is not None or all(w.is_completed() for w in self._works)

    def wait(self) -> torch.Tensor:
        if self._finish is not None:
            for work in self._works:
                work.wait()
            self._result, self._finish = self._finish(), None
        assert self._result is not None
        return self._result


def poll(handle: Handle) -> bool:
    """True when the collective behind `handle` has finished (synchronize() will not wait)."""
    return handle.done()


def synchronize(handle: Handle) -> torch.Tensor:
    """Wait for the collective behind `handle`; returns its result (the same tensor for in-place calls)."""
    if not isinstance(handle, Handle):
        raise ValueError(f"hvd.synchronize() takes a handle from an *_async call, not {type(handle).__name__}")
    return handle.wait()


class _GlobalProcessSet:
    """Horovod's hvd.global_process_set: all ranks, the only process set trainmesh.compat.horovod supports."""

    def __repr__(self) -> str:
        return "hvd.global_process_set"


global_process_set = _GlobalProcessSet()


def add_process_set(ranks: object) -> None:
    raise NotImplementedError(
        f"hvd.add_process_set({ranks!r}): process sets are not supported; every collective spans all ranks. "
        "Fix: drop process_set=, or use torch.distributed.new_group for a subgroup."
    )


def check_process_set(what: str, process_set: object) -> None:
    if process_set is not None and process_set is not global_process_set:
        raise ValueError(f"{what}(process_set={process_set!r}): only hvd.global_process_set (all ranks) is supported")


def _check(what: str, process_set: object, tensor: torch.Tensor | None = None) -> None:
    check_process_set(what, process_set)
    if tensor is not None and not tensor.is_contiguous():
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


def allreduce_async_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle:
    """Start reducing `tensor` in place over all ranks (Average by default: the sum divided by hvd.size(),
    floor division for integer tensors, as Horovod's)."""
    reduce_op = resolve_op(op, average, "hvd.allreduce")
    _check("hvd.allreduce", process_set, tensor)
    fields = (int(reduce_op), dtype_code(tensor.dtype), tensor.numel(), int(tensor.device.type == "cuda"))
    header = start_round(Kind.ALLREDUCE, fields)
    if prescale_factor != 1.0:
        tensor.mul_(prescale_factor)
    work = dist.all_reduce(tensor, op=TORCH_OPS[reduce_op], async_op=True)

    def finish() -> torch.Tensor:
        if reduce_op == ReduceOp.Average:
            if tensor.is_floating_point() or tensor.is_complex():
                tensor.div_(size())
            else:
                tensor.div_(size(), rounding_mode="floor")
        if postscale_factor != 1.0:
            tensor.mul_(postscale_factor)
        return tensor

    return Handle([header, work], finish)


def allreduce_async(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: object = None,
) -> Handle:
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
    _check("hvd.allreduce", process_set)
    compressed, ctx = compression.compress(tensor)
    reduced = _Allreduce.apply(compressed, reduce_op, name, prescale_factor, postscale_factor)
    return compression.decompress(reduced, ctx)


class _Allreduce(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients reduced with the same op."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, op: ReduceOp, name: str | None, pre: float, post: float
    ) -> torch.Tensor:
        ctx.op, ctx.pre, ctx.post = op, pre, post
        return synchronize(allreduce_async(tensor, name=name, op=op, prescale_factor=pre, postscale_factor=post))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        reduced = synchronize(allreduce_async(grad, op=ctx.op, prescale_factor=ctx.pre, postscale_factor=ctx.post))
        return reduced, None, None, None, None


def grouped_allreduce(tensors: Sequence[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    """hvd.allreduce for each tensor (one collective each: no fusion)."""
    return [allreduce(t, **kwargs) for t in tensors]


def grouped_allreduce_(tensors: Sequence[torch.Tensor], **kwargs: Any) -> list[torch.Tensor]:
    handles = [allreduce_async_(t, **kwargs) for t in tensors]
    return [synchronize(h) for h in handles]


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> Handle:
    """Start concatenating every rank's `tensor` along dimension 0; the first dimension may differ between
    ranks, the others (and the dtype) may not. The sizes are exchanged first (blocking), then the tensors,
    padded to the largest, are gathered asynchronously."""
    return allgather_with_sizes(tensor, process_set)[0]


def allgather_with_sizes(tensor: torch.Tensor, process_set: object) -> tuple[Handle, list[int]]:
    """allgather_async, and how many rows each rank gave."""
    _check("hvd.allgather", process_set, tensor)
    if tensor.dim() == 0 or tensor.dim() > MAX_DIMS:
        raise ValueError(
            f"hvd.allgather: a tensor of {tensor.dim()} dimensions; allowed: 1 to {MAX_DIMS} (it is concatenated "
            "along dimension 0). Fix: tensor.reshape(1) for a scalar."
        )
    start_round(Kind.OTHER, what="hvd.allgather")
    n = size()
    mine = torch.zeros(2 + MAX_DIMS, dtype=torch.int64)
    mine[0], mine[1] = tensor.dim(), dtype_code(tensor.dtype)
    mine[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    headers = [torch.empty_like(mine, device=control_device()) for _ in range(n)]
    dist.all_gather(headers, mine.to(control_device()))
    rows = [h.tolist() for h in headers]
    sizes = [row[2] for row in rows]
    ours = rows[rank()]
    differ = [r for r, row in enumerate(rows) if row[:2] != ours[:2] or row[3:] != ours[3:]]
    if differ:
        shapes = {
            r: (tuple(row[2 : 2 + row[0]]), str(DTYPES[row[1]]).removeprefix("torch.")) for r, row in enumerate(rows)
        }
        raise ValueError(
            f"hvd.allgather: the tensors differ in more than their first dimension (rank: (shape, dtype)): {shapes}. "
            "Only the first dimension may differ between ranks."
        )
    longest = max(sizes)
    padded = tensor
    if tensor.shape[0] < longest:
        pad = tensor.new_zeros((longest - tensor.shape[0], *tensor.shape[1:]))
        padded = torch.cat([tensor, pad])
    parts = [torch.empty_like(padded) for _ in range(n)]
    work = dist.all_gather(parts, padded.detach(), async_op=True)

    def finish() -> torch.Tensor:
        return torch.cat([part[:count] for part, count in zip(parts, sizes, strict=True)])

    return Handle([work], finish), sizes


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: object = None) -> torch.Tensor:
    """Every rank's `tensor` concatenated along dimension 0 (sizes may differ); differentiable."""
    _check("hvd.allgather", process_set)
    return _Allgather.apply(tensor)


class _Allgather(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients summed over ranks, this rank's rows of the result."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        handle, sizes = allgather_with_sizes(tensor.contiguous(), None)
        ctx.sizes = sizes
        return synchronize(handle)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        summed = synchronize(allreduce_async(grad, op=ReduceOp.Sum))
        offset = sum(ctx.sizes[: rank()])
        return summed.narrow(0, offset, ctx.sizes[rank()])


def broadcast_async_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle:
    """Start overwriting `tensor` with root_rank's on every rank."""
    _check("hvd.broadcast", process_set, tensor)
    check_root(root_rank, "hvd.broadcast")
    start_round(Kind.OTHER, what="hvd.broadcast")
    return Handle([broadcast_work(tensor, root_rank)], lambda: tensor)


def broadcast_work(tensor: torch.Tensor, root_rank: int) -> dist.Work | None:
    """The broadcast itself, within a round the caller has started (broadcast_parameters: one for many)."""
    if size() == 1:
        return None
    return dist.broadcast(tensor.detach(), src=root_rank, async_op=True)


def check_root(root_rank: int, what: str) -> None:
    if not 0 <= root_rank < size():
        raise ValueError(f"{what}: root_rank={root_rank}, but the ranks are 0..{size() - 1}")


def broadcast_async(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> Handle:
    """broadcast_async_ on a copy: `tensor` is left as it is."""
    return broadcast_async_(tensor.detach().clone(memory_format=torch.contiguous_format), root_rank, name, process_set)


def broadcast_(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: str | None = None, process_set: object = None
) -> torch.Tensor:
    """root_rank's `tensor` on every rank (a copy; the input is left as it is); differentiable."""
    _check("hvd.broadcast", process_set)
    return _Broadcast.apply(tensor, root_rank)


class _Broadcast(torch.autograd.Function):
    """Horovod's gradient: the incoming gradients summed over ranks, on the root; zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int) -> torch.Tensor:
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        summed = synchronize(allreduce_async(grad, op=ReduceOp.Sum))
        return (summed if rank() == ctx.root_rank else torch.zeros_like(summed)), None


def barrier(process_set: object = None) -> None:
    """Wait until every rank has reached this call."""
    _check("hvd.barrier", process_set)
    start_round(Kind.OTHER, what="hvd.barrier")  # waits for every rank's header: a barrier in itself
