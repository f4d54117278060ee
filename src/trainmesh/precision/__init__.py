"""Precision settings, chosen by name (`train.precision`)."""

from __future__ import annotations

import torch

from trainmesh.config.schema import PRECISIONS, Float8Config
from trainmesh.core.errors import UserError
from trainmesh.precision.amp import MixedPrecision, ScaledMixedPrecision
from trainmesh.precision.base import Precision
from trainmesh.precision.fp8 import Float8MixedPrecision, fp8_problem, torchao_problem
from trainmesh.precision.full import BF16TruePrecision, FP32Precision

__all__ = ["Precision", "PrecisionError", "build_precision", "check_precision_supported"]


class PrecisionError(UserError, ValueError):
    """train.precision asks for what this device (or this installation) cannot do: a one-line error, exit 2."""


def check_precision_supported(name: str, device: torch.device, float8: Float8Config | None = None) -> None:
    """Reject a precision the device cannot run, before the model is built. `float8`: the [float8] section
    (fp8-mixed only)."""
    if name not in PRECISIONS:
        raise PrecisionError(f"train.precision={name!r} is not one of {', '.join(PRECISIONS)}")
    if name == "32-true":
        return
    if name == "fp8-mixed":
        problem = torchao_problem(name)
        if problem is None and not (float8 or Float8Config()).emulate:
            on_cuda = device.type == "cuda"
            capability = torch.cuda.get_device_capability(device) if on_cuda else None
            problem = fp8_problem(name, device.type, capability, torch.cuda.get_device_name(device) if on_cuda else "")
        if problem:
            raise PrecisionError(problem)
    if not torch.amp.is_autocast_available(device.type) and name.endswith("mixed"):
        raise PrecisionError(f"train.precision={name!r}: torch has no autocast for device {device}. Fix: 32-true.")
    if (
        name in ("bf16-mixed", "bf16-true", "fp8-mixed")
        and device.type == "cuda"
        and not torch.cuda.is_bf16_supported()
    ):
        name_of_gpu = torch.cuda.get_device_name(device)
        raise PrecisionError(
            f"train.precision={name!r} but {name_of_gpu} has no bfloat16 support (needs compute capability "
            "8.0+, e.g. A100/H100). Fix: --train.precision=16-mixed on this GPU."
        )
    if name == "16-mixed" and device.type == "mps" and not hasattr(torch.amp, "GradScaler"):
        raise PrecisionError("train.precision='16-mixed' needs torch.amp.GradScaler for MPS. Fix: 32-true.")


def build_precision(name: str, device: torch.device, float8: Float8Config | None = None) -> Precision:
    check_precision_supported(name, device, float8)
    if name == "bf16-mixed":
        return MixedPrecision(device, torch.bfloat16)
    if name == "16-mixed":
        return ScaledMixedPrecision(device)
    if name == "bf16-true":
        return BF16TruePrecision()
    if name == "fp8-mixed":
        return Float8MixedPrecision(device, float8)
    return FP32Precision()
