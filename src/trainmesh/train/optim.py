"""AdamW with decoupled weight-decay groups, and the warmup + decay learning-rate schedule.

The schedule is a pure function of the step (nanoGPT style), so resuming at step s needs nothing but s.
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from trainmesh.config.schema import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW where matrices and embeddings decay and biases / norm weights (1-D tensors) do not."""
    params = [p for p in model.parameters() if p.requires_grad]  # unique even with tied weights
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    fused = _use_fused(cfg.fused, device)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused)


def _use_fused(setting: bool | None, device: torch.device) -> bool | None:
    """optim.fused: None (unset) means on CUDA only; torch's own default (None) where it is off."""
    supported = "fused" in inspect.signature(torch.optim.AdamW).parameters
    if setting is False or not supported:
        return None
    return True if setting or device.type == "cuda" else None


def lr_at(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then the chosen decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant" or max_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (max_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.lr - (cfg.lr - cfg.min_lr) * progress
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
