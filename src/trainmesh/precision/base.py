"""The Precision seam: how numbers are represented during forward, backward and the optimizer step.

The loop only ever calls these methods; which precision is active is decided once, in `build_precision`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class Precision(ABC):
    """Autocast, loss scaling and the optimizer step for one precision setting."""

    name: str
    scales_loss = False
    """True when the precision itself skips steps whose gradients overflow (a GradScaler)."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast the model's parameters if this precision stores them in a low-precision dtype, or swap its layers
        for low-precision ones (fp8-mixed); the whole model, before the strategy shards, splits or compiles it."""
        return module

    def attach(self, module: nn.Module) -> None:
        """The model as the strategy left it on this rank (sharded, or this rank's pipeline stages): for a
        precision that works on it after each optimizer step. Called once per model by Runtime.setup."""
        del module  # most precisions only need the optimizer

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The region where forward and loss run (autocast for the mixed modes)."""
        yield

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients to their true magnitude; called once per step, before clipping."""
        del optimizer  # only loss-scaling precisions have anything to undo

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> bool:
        """Take the optimizer step; False when it was skipped (loss-scale overflow). `closure`: for an optimizer
        that evaluates the loss itself, maybe several times (LBFGS)."""
        optimizer.step() if closure is None else optimizer.step(closure)  # a step() of its own may take none
        return True

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state

    @property
    def gather_dtype(self) -> torch.dtype | None:
        """The dtype sharded parameters are gathered in for compute (FSDP); None: as stored."""
        return None

    @property
    @abstractmethod
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and gradients are computed in (its rounding sets parity's tolerances)."""

    @property
    def peak_dtype(self) -> torch.dtype:
        """The dtype whose tensor-core peak the matrix multiplies run at (MFU counts against it)."""
        return self.compute_dtype
