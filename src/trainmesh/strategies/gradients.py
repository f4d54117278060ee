"""Gradient norm and clipping when gradients are split across ranks in more than one way.

A model may hold plain tensors (replicated), DTensor shards over one mesh (fsdp) or another
(tensor parallel, or both), and a pipeline stage holds only some of the layers. The global norm is
sqrt(sum of squares over every element of every gradient, each counted once):

    DTensors   grouped by (mesh, placements); each group's norm is completed over its mesh
    plain      replicated on their peers, so counted as they are
    stages     the squares of each stage's gradients are summed over the pipeline group
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from trainmesh.core.dtensors import is_dtensor


def grad_norm(params: Sequence[torch.Tensor], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The L2 norm of the gradients of `params`, completed over `group` (pipeline stages) if given."""
    held = [p for p in params if p.grad is not None]
    device = held[0].grad.device if held and held[0].grad is not None else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=getattr(device, "type", device))
    for same in _by_layout(held).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in same if p.grad is not None])
        if is_dtensor(norm):
            norm = norm.full_tensor()
        squares += norm.double() ** 2
    if group is not None:
        dist.all_reduce(squares, group=group)
    return squares.sqrt().float()


def clip_gradients(
    params: Sequence[torch.Tensor],
    max_norm: float,
    group: dist.ProcessGroup | None = None,
    counted: Sequence[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Scale the gradients of `params` so their global norm is at most `max_norm` (<= 0: no clipping);
    returns the norm before clipping. `counted`: the parameters that enter the norm, when some of
    `params` are copies held elsewhere too (a weight tied across pipeline stages)."""
    total = grad_norm(params if counted is None else counted, group)
    if max_norm > 0:  # torch's own scaling (fused per device and dtype), on the device: the norm is not read back
        for same in _by_layout(p for p in params if p.grad is not None).values():  # a fused multiply takes one
            torch.nn.utils.clip_grads_with_norm_(same, max_norm, total)  # mesh and placement at a time
    return total


def _by_layout(params: Iterable[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    """`params` grouped by their gradients' mesh and placements (plain tensors: one group)."""
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        g = p.grad
        groups[(g.device_mesh, tuple(g.placements)) if is_dtensor(g) else None].append(p)
    return groups
