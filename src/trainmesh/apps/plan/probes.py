"""What a rank holds during a step, by component, measured the way the planner predicts it: the bytes of this rank's
local tensors (a DTensor counts its shard), each storage once (views such as q, k and v of one qkv output, or a tied
weight, are one storage). Used by the dry run (dryrun.py, on fake tensors) and the planner's validation on real
processes (benchmarks/plan_measure.py); storages are told apart by identity, which both kinds of tensor have.

Details: docs/internals.md#appsplanprobespy
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def storage_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of the storages behind `tensors` (non-tensors skipped), each counted once."""
    storages = {id(s): s.nbytes() for t in tensors if isinstance(t, torch.Tensor) for s in [local(t).untyped_storage()]}
    return sum(storages.values())


def optimizer_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Everything the optimizer keeps (AdamW: exp_avg, exp_avg_sq, step)."""
    return storage_bytes(v for state in optimizer.state.values() for v in state.values())


class _Held:
    """What autograd keeps for one saved tensor (the pack hook's result): the tensor, and a call for when autograd
    lets go of it, which it does once the tensor's node has run in backward."""

    __slots__ = ("release", "tensor")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class SavedActivations:
    """The peak of the bytes autograd holds for backward: use `pack`/`unpack` as
    `torch.autograd.graph.saved_tensors_hooks` around the step.

    A storage counts from the first tensor saved on it until autograd has let go of the last one. A block's input
    counts from the block's forward pre-hook until the gradient for it is computed: that is how long activation
    checkpointing keeps it (its own hooks take over inside the block; without checkpointing ln_1 saves the same
    storage). Storages of parameters (linear layers save their weight; under FSDP the gathered one) are not
    activations. A pipeline (1F1B) frees one piece's saved tensors while later ones are saved: only the live peak
    is its memory."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.live: dict[int, list[Any]] = {}  # id(storage) -> [storage, holds, where]
        self.where = "outside"  # in a block's forward, or outside the blocks (embeddings, head, loss)
        self.now = {"blocks": 0, "outside": 0}
        self.peak, self.peak_split = 0, dict(self.now)
        self.closed = False
        self.handles: list[RemovableHandle] = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter))
            self.handles.append(block.register_forward_hook(self._leave))

    def _hold(self, t: torch.Tensor, where: str) -> Callable[[], None] | None:
        """Count `t`'s storage as held; returns what ends this hold, or None for one that is no activation."""
        if isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter):  # a weight, or a view of one (w.t())
            return None
        storage = local(t).untyped_storage()
        key = id(storage)
        if storage.nbytes() == 0:
            return None
        entry = self.live.get(key)
        if entry is None:  # a held storage stays alive, so its id is not reused while it counts
            entry = self.live[key] = [storage, 0, where]
            self.now[where] += storage.nbytes()
            if sum(self.now.values()) > self.peak:
                self.peak, self.peak_split = sum(self.now.values()), dict(self.now)
        entry[1] += 1
        return functools.partial(self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now[entry[2]] -= entry[0].nbytes()
            del self.live[key]

    def pack(self, t: torch.Tensor) -> Any:
        release = self._hold(t, self.where)
        return t if release is None else _Held(t, release)

    @staticmethod
    def unpack(packed: Any) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Held) else packed

    def _enter(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        del module
        self.where = "blocks"
        for arg in args:
            if isinstance(arg, torch.Tensor) and arg.requires_grad and (release := self._hold(arg, "blocks")):
                # once: a pipeline stage's input is torch's receive buffer, reused by every micro-step
                self.handles.append(arg.register_hook(functools.partial(self._input_done, release, [False])))

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        del module, args, output
        self.where = "outside"

    def _input_done(self, release: Callable[[], None], done: list[bool], grad: torch.Tensor) -> None:
        del grad
        if not self.closed and not done[0]:
            done[0] = True
            release()

    def close(self) -> int:
        """Stop watching; the peak (its split: `peak_split`; what is still held: `now`, 0 after a whole step unless
        something keeps a saved tensor past its backward)."""
        self.closed = True
        for handle in self.handles:
            handle.remove()
        return self.peak


def outermost_fsdp_units(module: nn.Module) -> list[nn.Module]:
    """The FSDP units of `module` that no other unit contains: the model, or each pipeline stage, under fsdp."""
    if isinstance(module, FSDPModule):
        return [module]
    return [unit for child in module.children() for unit in outermost_fsdp_units(child)]


class GatheredParams:
    """The most bytes of unsharded parameters FSDP still holds when a forward of an outermost unit ends (held in
    addition to the shards until backward: every unit without resharding after forward; none with it)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.at_rest = {id(p) for p in model.parameters()}  # the shards (FSDP registers them between steps)
        self.peak = 0
        # Registered after fully_shard's own hooks, so these run after its post-forward resharding.
        self.handles = [unit.register_forward_hook(self._after_forward) for unit in outermost_fsdp_units(model)]

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        del module, args, output
        self.peak = max(self.peak, storage_bytes(p for p in self.model.parameters() if id(p) not in self.at_rest))

    def close(self) -> int:
        for handle in self.handles:
            handle.remove()
        return self.peak
