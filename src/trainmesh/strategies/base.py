"""The Strategy seam: how the model is wrapped, how gradients are synchronised and how state is saved.

The training loop calls only these methods (`forward_backward`, `no_sync`, `clip_grad_norm`,
`state_dicts`); it never asks which strategy it runs under, so new strategies (FSDP, pipeline) plug in
here without touching the loop.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from trainmesh.precision import Precision
from trainmesh.runtime.env import DistEnv
from trainmesh.strategies.blocks import BlockOptions, find_blocks, transform_blocks

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Strategy(ABC):
    """One way of placing a model on devices and keeping its replicas or shards consistent."""

    name: str
    collective_forward = False
    """Whether a forward pass communicates (sharded parameters): then every rank must run the same
    number of forwards, e.g. in evaluation, and none may run one alone."""

    def __init__(self, env: DistEnv, device: torch.device, blocks: BlockOptions | None = None) -> None:
        self.env = env
        self.device = device
        self.block_options = blocks or BlockOptions()

    # -- data-parallel geometry: which slice of each global batch this process reads ----------------
    @property
    def dp_size(self) -> int:
        """Number of data-parallel replicas whose gradients are averaged."""
        return 1

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def devices_per_process(self) -> int:
        """Accelerators one process computes on (several only for nn.DataParallel); used for MFU."""
        return 1

    # -- model --------------------------------------------------------------------------------------
    def setup_module(self, module: nn.Module, blocks: list[nn.Module] | None = None) -> nn.Module:
        """Transform the model's blocks (strategies/blocks.py), then place and wrap it; returns the
        module to train. `blocks`: the model's repeated units (default: those in nn.ModuleLists)."""
        blocks = find_blocks(module) if blocks is None else blocks
        transform_blocks(module, blocks, self.block_options)
        return self.wrap(module, blocks)

    @abstractmethod
    def wrap(self, module: nn.Module, blocks: list[nn.Module]) -> nn.Module:
        """Move the model to its device(s) and wrap it for this strategy."""

    def unwrap(self, module: nn.Module) -> nn.Module:
        """The user's own module inside any wrapper (for sampling, export, parameter counts)."""
        inner = getattr(module, "module", None)
        return inner if isinstance(inner, nn.Module) else module

    @contextlib.contextmanager
    def no_sync(self, module: nn.Module, enabled: bool) -> Iterator[None]:
        """Skip gradient synchronisation for non-final micro-steps of an accumulation window."""
        del module, enabled
        yield

    def forward_backward(
        self, module: nn.Module, batch: Any, loss_fn: LossFn, scale: Callable[[], float], precision: Precision
    ) -> torch.Tensor:
        """Run forward and backward on one micro-batch; returns the unscaled loss (detached).

        `scale()` turns the recipe's summed loss into this micro-batch's share of the global mean, with
        the gradient averaging of data parallelism already accounted for (see train/batch.py). It is
        called after the forward, so the all-reduce it may wait for overlaps the forward pass.
        """
        with precision.autocast():
            loss = loss_fn(module, batch)
        precision.backward(loss * scale())
        return loss.detach()

    def clip_grad_norm(self, module: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip to `max_norm` (no clipping when <= 0) and return the total norm before clipping."""
        limit = max_norm if max_norm > 0 else float("inf")
        return torch.nn.utils.clip_grad_norm_(module.parameters(), limit)

    # -- state --------------------------------------------------------------------------------------
    def state_dicts(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
        """Model and optimizer state keyed by parameter name, free of wrapper prefixes (DCP-ready)."""
        return get_state_dict(module, optimizer)

    def load_state_dicts(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        model_state: dict[str, Any],
        optim_state: dict[str, Any],
    ) -> None:
        set_state_dict(module, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
