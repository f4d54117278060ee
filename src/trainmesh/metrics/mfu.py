"""Model FLOPs utilisation: achieved training FLOP/s over the device's dense peak.

FLOPs per token follow nanoGPT: 6·N + 12·L·H·Q·T (N parameters without position embeddings, L layers,
H heads, Q head size, T sequence length). Peaks are dense (not 2:4 sparse) figures; on a device not in
the table MFU is not reported, only tokens/s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# (device-name fragment, dense peak FLOP/s for bf16/fp16 tensor cores, for TF32 tensor cores, for plain fp32).
# First match wins, so the PCIe/NVL variants come before the bare "H100" (SXM). A float32 run counts against
# the TF32 peak when train.tf32 lets its matmuls use TF32 (trainmesh's default on CUDA), else the fp32 one.
_PEAKS: list[tuple[str, float, float, float]] = [
    ("H200", 989e12, 494.7e12, 67e12),
    ("H100 PCIe", 756e12, 378e12, 51e12),
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100", 989e12, 494.7e12, 67e12),
    ("A100", 312e12, 156e12, 19.5e12),
]

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
    for fragment, half_flops, tf32_flops, fp32_flops in _PEAKS:
        if fragment in name:
            if dtype != torch.float32:
                return Peak(name, dtype, half_flops)
            return Peak(name, dtype, tf32_flops, "TF32") if tf32 else Peak(name, dtype, fp32_flops)
    return None


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak: Peak | None) -> float | None:
    if peak is None or flops_per_token <= 0:
        return None
    return flops_per_token * tokens_per_s_per_device / peak.flops
