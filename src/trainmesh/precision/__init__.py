"""Precision settings, chosen by name (`train.precision`)."""

from __future__ import annotations

import torch

from trainmesh.config.schema import PRECISIONS
from trainmesh.precision.amp import MixedPrecision, ScaledMixedPrecision
from trainmesh.precision.base import Precision
from trainmesh.precision.full import BF16TruePrecision, FP32Precision

__all__ = ["Precision", "build_precision", "check_precision_supported"]


def check_precision_supported(name: str, device: torch.device) -> None:
    """Reject a precision the device cannot run, before the model is built."""
    if name not in PRECISIONS:
        raise ValueError(f"train.precision={name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "32-true":
        return
    if not torch.amp.is_autocast_available(device.type) and name.endswith("mixed"):
        raise ValueError(f"train.precision={name!r}: torch has no autocast for device {device}. Fix: 32-true.")
    if "bf16" in name and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        name_of_gpu = torch.cuda.get_device_name(device)
        raise ValueError(
            f"train.precision={name!r} but {name_of_gpu} has no bfloat16 support (needs compute capability "
            "8.0+, e.g. A100/H100). Fix: --train.precision=16-mixed on this GPU."
        )
    if name == "16-mixed" and device.type == "mps" and not hasattr(torch.amp, "GradScaler"):
        raise ValueError("train.precision='16-mixed' needs torch.amp.GradScaler for MPS. Fix: 32-true.")


def build_precision(name: str, device: torch.device) -> Precision:
    check_precision_supported(name, device)
    if name == "bf16-mixed":
        return MixedPrecision(device, torch.bfloat16)
    if name == "16-mixed":
        return ScaledMixedPrecision(device)
    if name == "bf16-true":
        return BF16TruePrecision()
    return FP32Precision()
