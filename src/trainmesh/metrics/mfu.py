"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak, FLOPs per token counted as nanoGPT
does; not reported for a device not in the table.

Details: docs/internals.md#metricsmfupy
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (device-name fragment, dense peak FLOP/s for bf16/fp16 tensor cores, for TF32 tensor cores, for plain fp32, for
# fp8 tensor cores or None without them). NVIDIA's datasheets (H100: nvidia.com/en-us/data-center/h100, H200:
# nvidia.com/en-us/data-center/h200, A100: nvidia.com/en-us/data-center/a100) give tensor-core figures "with
# sparsity": the dense peaks here are half of them (H100 SXM: FP8 3,958 -> 1,979 TFLOP/s, BF16 1,979 -> 989).
# First match wins, so the PCIe/NVL variants come before the bare "H100" (SXM). A float32 run counts against
# the TF32 peak when train.tf32 lets its matmuls use TF32 (trainmesh's default on CUDA), else the fp32 one; an
# fp8-mixed run against the fp8 peak, although its attention and output head compute in bf16: its MFU is a
# lower bound, comparable between fp8 runs, not with a bf16 run's.
_PEAKS: list[tuple[str, float, float, float, float | None]] = [
    ("H200", 989e12, 494.7e12, 67e12, 1979e12),
    ("H100 PCIe", 756e12, 378e12, 51e12, 1513e12),
    ("H100 NVL", 835e12, 417.5e12, 60e12, 1670.5e12),
    ("H100", 989e12, 494.7e12, 67e12, 1979e12),
    ("A100", 312e12, 156e12, 19.5e12, None),
]
FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)

FORMULA = "MFU = tokens/s × (6·N + 12·L·H·Q·T) / peak"


@dataclass(frozen=True)
class Peak:
    device_name: str
    dtype: torch.dtype
    flops: float
    math: str = ""
    """How the matmuls run when it is not simply `dtype` (e.g. TF32 tensor cores for float32)."""

    def describe(self) -> str:
        how = f"{self.dtype} on {self.math}" if self.math else str(self.dtype)
        return f"{FORMULA}, peak {self.flops / 1e12:.1f} TFLOP/s ({self.device_name}, {how}, dense)"


def device_peak(device: torch.device, dtype: torch.dtype, tf32: bool = False) -> Peak | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, half_flops, tf32_flops, fp32_flops, fp8_flops in _PEAKS:
        if fragment in name:
            if dtype in FLOAT8:
                return (
                    Peak(name, dtype, fp8_flops, "FP8 tensor cores, attention and head in bf16") if fp8_flops else None
                )
            if dtype != torch.float32:
                return Peak(name, dtype, half_flops)
            return Peak(name, dtype, tf32_flops, "TF32") if tf32 else Peak(name, dtype, fp32_flops)
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: Peak | None) -> float | None:
    if peak is None or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_s_per_device / peak.flops
