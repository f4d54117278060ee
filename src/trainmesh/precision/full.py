"""Precisions without autocast: `32-true` (everything fp32) and `bf16-true` (parameters stored in bf16)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainmesh.precision.base import Precision


class FP32Precision(Precision):
    """`32-true`: fp32 parameters, activations and gradients; the reference for parity."""

    name = "32-true"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32


class BF16TruePrecision(Precision):
    """`bf16-true`: the model itself is bf16 (half the memory of fp32, no master weights)."""

    name = "bf16-true"

    def convert_module(self, module: nn.Module) -> nn.Module:
        module.to(dtype=torch.bfloat16)
        # No autocast here, so float inputs (images) are cast on their way in, or they would meet bf16 weights.
        # Targets never enter the model: they keep their dtype.
        module.register_forward_pre_hook(_floats_to_bf16)
        return module

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16


def _floats_to_bf16(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """Forward pre-hook: the module's positional inputs, with every floating-point tensor in bf16."""
    del module
    return tuple(_to_bf16(a) for a in args)


def _to_bf16(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(torch.bfloat16) if value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to_bf16(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_bf16(v) for k, v in value.items()}
    return value
