"""Mixed precision with torch.amp: fp32 master weights, low-precision matmuls under autocast.

`16-mixed` also needs loss scaling (fp16 gradients underflow): a GradScaler scales the loss before
backward, `unscale` restores true gradients before clipping, and a step whose gradients hold inf/NaN
is skipped. Under data parallelism the gradients are all-reduced before the check, so every rank sees
the same inf and takes the same skip decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

from trainmesh.precision.base import Precision


class MixedPrecision(Precision):
    """`bf16-mixed`: autocast to bfloat16; bf16 has fp32's range, so no loss scaling is needed."""

    name = "bf16-mixed"

    def __init__(self, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> None:
        self.device_type = device.type
        self.dtype = dtype

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        with torch.autocast(device_type=self.device_type, dtype=self.dtype):
            yield

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.dtype

    @property
    def gather_dtype(self) -> torch.dtype | None:
        return self.dtype


class ScaledMixedPrecision(MixedPrecision):
    """`16-mixed`: autocast to float16 with dynamic loss scaling."""

    name = "16-mixed"
    scales_loss = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, torch.float16)
        self.scaler = torch.amp.GradScaler(device.type)
        self._scaled = False  # a loss was scaled since the last backward-free step...
        self._stepped: set[int] = set()  # ... of these optimizers (ids): their gradients are the scaler's to step
        self._unscaled: set[int] = set()  # optimizers unscaled for this step (GradScaler allows one unscale_)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()
        self._scaled = True
        self._stepped.clear()
        self._unscaled.clear()

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self._scaled and id(optimizer) not in self._stepped | self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any] | None = None) -> bool:
        if closure is not None:
            raise ValueError(
                "train.precision='16-mixed' steps through torch's GradScaler, which takes no closure (the gradients "
                "a closure makes would be stepped unchecked). Fix: call the closure before the step, or use "
                "--train.precision=bf16-mixed."
            )
        if self._scaled and self._stepped and id(optimizer) not in self._stepped:
            raise ValueError(
                "train.precision='16-mixed' with a second optimizer stepped after one backward: the loss scaler "
                "updates its scale once per step, so the second one's gradients would be unscaled by another scale "
                "than they were scaled with. Fix: one optimizer with parameter groups (torch.optim.AdamW([{'params': "
                "...}, {'params': ..., 'lr': ...}])), or --train.precision=bf16-mixed."
            )
        if not self._scaled or id(optimizer) in self._stepped:
            # No loss was scaled since this optimizer's last step: no scaled gradients to unscale or check. DCP
            # takes such a step (zero gradients, lr 0) to create an empty optimizer's state, through the optimizer
            # rt.setup returned (runtime/optimizer.py).
            optimizer.step()
            return True
        self.unscale(optimizer)
        scale_before = self.scaler.get_scale()
        self.scaler.step(optimizer)  # skips optimizer.step() when the unscaled grads hold inf/NaN
        self.scaler.update()  # ... and then lowers the scale, which is how we detect the skip
        self._stepped.add(id(optimizer))
        self._unscaled.discard(id(optimizer))
        return self.scaler.get_scale() >= scale_before

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
