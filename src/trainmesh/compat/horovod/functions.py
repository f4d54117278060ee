"""hvd.broadcast_parameters, broadcast_optimizer_state, broadcast_object and allgather_object.

Objects travel pickled, by torch's object collectives (Horovod uses cloudpickle; plain pickle here, so lambdas
and local classes cannot travel). The bytes come from the job's own ranks, the same trust as Horovod's.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.compat.horovod.agreement import Call
from trainmesh.compat.horovod.basics import ReduceOp, rank, size
from trainmesh.compat.horovod.gather import broadcast_work, check_root
from trainmesh.compat.horovod.ops import allreduce, on_wire
from trainmesh.compat.horovod.optimizer import _DistributedOptimizer
from trainmesh.compat.horovod.process_sets import global_process_set, resolve
from trainmesh.compat.horovod.rounds import Kind, own_checks, start_round


def broadcast_parameters(params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int) -> None:
    """Overwrite every tensor in `params` with root_rank's: a state_dict (its tensors are sorted by name, as
    Horovod does), model.named_parameters() or model.parameters(). One round, then all broadcasts at once."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, torch.Tensor):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}; give a state_dict or named_parameters()")
    with own_checks():
        for name, tensor in items:
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"hvd.broadcast_parameters: entry {name!r} is a {type(tensor).__name__}, not a tensor")
        check_root(root_rank, global_process_set, "hvd.broadcast_parameters")
    layout = zlib.crc32(repr([(tuple(t.shape), t.dtype) for _, t in items]).encode())  # the ranks must agree on it
    start_round(
        Kind.OTHER, Call("hvd.broadcast_parameters", f"{len(items)} tensors, layout {layout:08x}", root=root_rank)
    )
    pending = []
    for _, tensor in items:
        target = on_wire(tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous())
        pending.append((tensor, target, broadcast_work(target, root_rank)))
    for tensor, target, work in pending:
        if work is not None:
            work.wait()
        if target.data_ptr() != tensor.data_ptr():  # it went through a contiguous (or int16: int32) copy
            with torch.no_grad():
                tensor.copy_(target)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int) -> None:
    """Give every rank root_rank's optimizer state and param_group options (learning rate, betas, ...).

    As Horovod: an optimizer without any state first gets it from one step with zero gradients (every
    parameter that requires a gradient gets a zero .grad; for SGD and Adam without weight decay the weights do
    not move, but the step count becomes 1); a DistributedOptimizer takes that step without all-reducing.
    Refused, as by Horovod: torch.optim.LBFGS. Before any tensor moves, the ranks check that their state
    has root_rank's structure (the same entries, shapes and dtypes) and all raise together if not.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    with own_checks():
        check_root(root_rank, global_process_set, "hvd.broadcast_optimizer_state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if not optimizer.state:
        for p in params:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        if isinstance(optimizer, _DistributedOptimizer):
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    layout, values = _layout(optimizer, params)
    options = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    theirs = broadcast_object((layout, options, values), root_rank, name="optimizer_state")
    same = theirs[0] == layout and len(theirs[1]) == len(options)
    agree = allreduce(torch.tensor([int(same)]), op=ReduceOp.Min, name="optimizer_state.agree")
    if not int(agree.item()):
        raise ValueError(
            f"hvd.broadcast_optimizer_state: the optimizer state of {'this rank' if not same else 'another rank'} "
            f"does not have rank {root_rank}'s structure (state entries, shapes, dtypes or param groups differ). "
            "Fix: build the same optimizer over the same model on every rank before broadcasting."
        )
    if rank() != root_rank:
        for group, their_options in zip(optimizer.param_groups, theirs[1], strict=True):
            group.update(their_options)
        for (i, name), value in theirs[2].items():
            optimizer.state[params[i]][name] = value
    tensors = [(f"{i}.{name}", optimizer.state[params[i]][name]) for i, name, kind in layout if kind[0] == "tensor"]
    broadcast_parameters(tensors, root_rank)


def _layout(
    optimizer: torch.optim.Optimizer, params: list[torch.Tensor]
) -> tuple[list[tuple[int, str, tuple[Any, ...]]], dict[tuple[int, str], Any]]:
    """(parameter index, state name, ("tensor", shape, dtype) or ("value",)) of every state entry, in
    param_groups order; and the entries that are plain values (not tensors)."""
    layout: list[tuple[int, str, tuple[Any, ...]]] = []
    values: dict[tuple[int, str], Any] = {}
    for i, p in enumerate(params):
        for name, value in sorted(optimizer.state.get(p, {}).items()):
            if isinstance(value, torch.Tensor):
                layout.append((i, name, ("tensor", tuple(value.shape), str(value.dtype))))
            else:
                layout.append((i, name, ("value",)))
                values[(i, name)] = value
    return layout, values


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = None) -> Any:
    """root_rank's `obj` on every member of the process set (all ranks by default; root_rank is a global rank),
    pickled, through torch's broadcast_object_list."""
    ps = resolve(process_set, "hvd.broadcast_object")
    with own_checks(ps.group):
        check_root(root_rank, ps, "hvd.broadcast_object")
    if ps.size() == 1:
        return obj
    start_round(Kind.OTHER, Call("hvd.broadcast_object", name, root=root_rank), group=ps.group)
    box = [obj if rank() == root_rank else None]
    dist.broadcast_object_list(box, src=root_rank, group=ps.group)
    return obj if rank() == root_rank else box[0]


def allgather_object(obj: Any, name: str | None = None) -> list[Any]:
    """Every rank's `obj`, in rank order (pickled, through torch's all_gather_object)."""
    if size() == 1:
        return [obj]
    start_round(Kind.OTHER, Call("hvd.allgather_object", name))
    gathered: list[Any] = [None] * size()
    dist.all_gather_object(gathered, obj)
    return gathered
