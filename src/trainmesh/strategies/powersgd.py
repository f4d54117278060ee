"""PowerSGD gradient compression for DDP (torch's `powerSGD_hook`), with a state that survives a resume: error
feedback and warm start are kept per parameter, as a resumed DDP does not have the same buckets.

Details: docs/internals.md#strategiespowersgdpy
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
from torch.nn.parallel import DistributedDataParallel

from trainmesh.core.logging import get_logger

log = get_logger(__name__)
Pieces = dict[str, dict[str, torch.Tensor]]
"""Per parameter name: its "error" (flat, numel values) and, when compressed, its "q" (m·r' values)."""


class PowerSGD:
    """PowerSGD for `ddp` (`hook`), and its per-rank state for checkpoints (`rank_state`/`load_rank_state`)."""

    def __init__(self, ddp: DistributedDataParallel, rank: int, start_iter: int) -> None:
        group = ddp.process_group
        self.state = powersgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=start_iter,
            use_error_feedback=True,
            warm_start=True,
        )
        self._names = {id(p): name for name, p in ddp.module.named_parameters()}
        self._serial = dist.get_backend(group) == "gloo"
        """torch's hook issues each bucket's second and third collective from the callback of the one before,
        which gloo runs on its own threads, whenever that finishes: two buckets' collectives could then reach
        the ranks in different orders (a hang). On gloo each bucket's exchange is finished before the next."""
        self._layout: dict[int, list[tuple[str, torch.Size]]] = {}
        """Bucket index -> (parameter name, shape) of its gradients, in order, as last seen."""
        self._pieces: Pieces = {}
        """State not in torch's per-bucket dicts right now: loaded, or cut out at a bucket rebuild."""

    def hook(self, state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The DDP communication hook (register it on the DDP module this was made for)."""
        del state  # this object's
        return self._hook(bucket)

    def _hook(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        index = bucket.index()
        layout = [(self._names[id(p)], p.shape) for p in bucket.parameters()]
        if self._layout.get(index, layout) != layout:  # DDP rebuilt its buckets: re-key the state
            self._pieces.update(self._cut_all())
            self._layout.clear()
        if index not in self._layout:
            self._layout[index] = layout
            self._assemble(index, layout, bucket.buffer())
        future = powersgd.powerSGD_hook(self.state, bucket)
        if self._serial:
            future.wait()
        return future

    # -- checkpoints --------------------------------------------------------------------------------
    def rank_state(self) -> dict[str, Any]:
        """This rank's state as CPU tensors (for a file loaded with weights_only)."""
        pieces = {**self._pieces, **self._cut_all(clear=False)}
        kind, keys, pos, has_gauss, gauss = cast(tuple[Any, ...], self.state.rng.get_state(legacy=True))
        return {
            "iter": self.state.iter,
            "rng": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss)],
            "params": {name: {k: v.detach().cpu().clone() for k, v in p.items()} for name, p in pieces.items()},
        }

    def load_rank_state(self, saved: Any) -> None:
        """Restore `rank_state()`'s output (None: none was saved; the state starts afresh). A file that does not
        read as one, or holds non-finite values, is not used at all (a warning says so)."""
        if saved is None:
            return
        try:
            kind, keys, pos, has_gauss, gauss = saved["rng"]
            rng = (str(kind), keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss))
            step = int(saved["iter"])
            pieces = {
                str(name): {k: v for k, v in p.items() if k in ("error", "q")} for name, p in saved["params"].items()
            }
            if not all(
                isinstance(v, torch.Tensor) and bool(v.isfinite().all()) for p in pieces.values() for v in p.values()
            ):
                raise ValueError("non-finite or non-tensor values")
            probe = np.random.RandomState()
            probe.set_state(rng)  # raises on a malformed state, before anything of ours changed
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a damaged or foreign file
            log.warning("the checkpoint's PowerSGD state is unusable (%s): PowerSGD starts afresh", e)
            return
        self.reset()
        self.state.rng.set_state(rng)
        self.state.iter = step
        self._pieces = pieces

    def reset(self) -> None:
        """Forget the error feedback and the warm-start Qs (after a skipped, non-finite step): the next step
        compresses afresh, with new random Qs. The step count and the random stream go on."""
        self.state.error_dict.clear()
        self.state.p_memory_dict.clear()
        self.state.q_memory_dict.clear()
        self._layout.clear()
        self._pieces = {}

    # -- per bucket <-> per parameter ---------------------------------------------------------------
    def _cut_all(self, clear: bool = True) -> Pieces:
        """torch's per-bucket state, cut into per-parameter pieces (and, with `clear`, taken out of torch's
        dicts: the buckets are about to change)."""
        pieces: Pieces = {}
        for index, layout in self._layout.items():
            error, q = self.state.error_dict.get(index), self.state.q_memory_dict.get(index)
            for name, (e, qs) in _slices(layout, self.state).items():
                piece = {}
                if error is not None:
                    piece["error"] = error[e]
                if q is not None and qs is not None:
                    piece["q"] = q[qs]
                if piece:  # before PowerSGD starts, there is no state
                    pieces[name] = piece
        if clear:
            self.state.error_dict.clear()
            self.state.p_memory_dict.clear()
            self.state.q_memory_dict.clear()
        return pieces

    def _assemble(self, index: int, layout: list[tuple[str, torch.Size]], buffer: torch.Tensor) -> None:
        """Put the pieces of this bucket's parameters into torch's dicts under `index`, if all are there
        with the right sizes (else PowerSGD starts this bucket afresh, with a warning)."""
        names = [name for name, _ in layout]
        if not any(name in self._pieces for name in names):
            return
        pieces = [self._pieces.pop(name, {}) for name in names]
        slices = _slices(layout, self.state)
        q_total = sum(s.stop - s.start for _, s in slices.values() if s is not None)
        try:
            has_error = all("error" in p for p in pieces)
            error = (
                torch.cat([p["error"].reshape(shape).flatten() for p, (_, shape) in zip(pieces, layout, strict=True)])
                if has_error
                else None
            )
            q = torch.empty(q_total, dtype=buffer.dtype)
            for piece, (_, s) in zip(pieces, slices.values(), strict=True):
                if s is not None:
                    q[s] = piece["q"].reshape(-1)
        except (KeyError, RuntimeError, AttributeError, TypeError) as e:  # a damaged or foreign file
            log.warning("PowerSGD state of bucket %d does not fit its parameters (%s): it starts afresh", index, e)
            return
        if error is not None:
            if error.numel() != buffer.numel():
                log.warning("PowerSGD error state of bucket %d has the wrong size: it starts afresh", index)
                return
            self.state.error_dict[index] = error.to(buffer.device, buffer.dtype)
        p_total = sum(n * r for n, _, r in filter(None, (_compressed(shape, self.state) for _, shape in layout)))
        self.state.p_memory_dict[index] = torch.empty(p_total, device=buffer.device, dtype=buffer.dtype)
        self.state.q_memory_dict[index] = q.to(buffer.device)


def _compressed(shape: torch.Size, state: Any) -> tuple[int, int, int] | None:
    """(n, m, r') when PowerSGD compresses a gradient of this shape (viewed as n × m, approximated at rank
    r' = min(n, m, r)): when that is smaller by more than `min_compression_rate`; else None."""
    numel = math.prod(shape)
    n = shape[0] if len(shape) else 1
    m = numel // n if n else 0
    r = min(n, m, state.matrix_approximation_rank)
    return (n, m, r) if (n + m) * r * state.min_compression_rate < numel else None


def _slices(layout: list[tuple[str, torch.Size]], state: Any) -> dict[str, tuple[slice, slice | None]]:
    """Per parameter: its slice of the bucket's error, and of its Q memory (None: not compressed).

    Qs are laid out grouped by matrix shape, shapes in the order first seen, bucket order within a shape."""
    errors, start = {}, 0
    by_shape: dict[tuple[int, int], list[tuple[str, int]]] = {}
    for name, shape in layout:
        errors[name] = slice(start, start + math.prod(shape))
        start = errors[name].stop
        if (matrix := _compressed(shape, state)) is not None:
            n, m, r = matrix
            by_shape.setdefault((n, m), []).append((name, m * r))
    qs, start = {}, 0
    for group in by_shape.values():
        for name, size in group:
            qs[name] = slice(start, start + size)
            start += size
    return {name: (errors[name], qs.get(name)) for name, _ in layout}
