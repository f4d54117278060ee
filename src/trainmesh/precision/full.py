"""Precisions without autocast: `32-true` (everything fp32) and `bf16-true` (parameters stored in bf16)."""

from __future__ import annotations

import torch
from torch import nn

from trainmesh.precision.base import Precision


class FullPrecision(Precision):
    """`32-true`: fp32 parameters, activations and gradients; the reference for parity."""

    name = "32-true"

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.float32


class TruePrecision(Precision):
    """`bf16-true`: the model itself is bf16 (half the memory of fp32, no master weights)."""

    name = "bf16-true"

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=torch.bfloat16)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16
