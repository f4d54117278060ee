"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak.

FLOPs per token follow nanoGPT: 6·N + 12·L·H·Q·T (N parameters without position embeddings, L layers,
H heads, Q head size, T sequence length). Peaks are dense (not 2:4 sparse) figures; on a device not in
the table MFU is not reported, only tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (device-name fragment, dtype) -> dense peak FLOP/s
_PEAKS: list[tuple[str, torch.dtype, float]] = [
    ("H200", torch.bfloat16, 989e12),
    ("H100", torch.bfloat16, 989e12),
    ("A100", torch.bfloat16, 312e12),
    ("H200", torch.float16, 989e12),
    ("H100", torch.float16, 989e12),
    ("A100", torch.float16, 312e12),
    ("H200", torch.float32, 494.5e12),  # TF32 tensor cores (the default for fp32 matmuls in trainmesh)
    ("H100", torch.float32, 494.5e12),
    ("A100", torch.float32, 156e12),
]

FORMULA = "MFU = tokens/s × (6·N + 12·L·H·Q·T) / peak"


@dataclass(frozen=True)
class Peak:
    device_name: str
    dtype: torch.dtype
    flops: float

    def describe(self) -> str:
        return f"{FORMULA}, peak {self.flops / 1e12:.1f} TFLOP/s ({self.device_name}, {self.dtype}, dense)"


def device_peak(device: torch.device, dtype: torch.dtype) -> Peak | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peak_dtype, flops in _PEAKS:
        if fragment in name and peak_dtype == dtype:
            return Peak(name, dtype, flops)
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: Peak | None) -> float | None:
    if peak is None or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_s_per_device / peak.flops
