from __future__ import annotations

import pytest
import torch

from trainmesh.config.schema import OptimConfig
from trainmesh.train.optim import build_optimizer, lr_at


def test_warmup_then_cosine_to_min_lr() -> None:
    cfg = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, cfg, 100) == pytest.approx(0.1)
    assert lr_at(9, cfg, 100) == pytest.approx(1.0)
    assert lr_at(55, cfg, 100) == pytest.approx(0.55)
    assert lr_at(100, cfg, 100) == pytest.approx(0.1)


def test_linear_and_constant() -> None:
    assert lr_at(55, OptimConfig(lr=1.0, min_lr=0.0, warmup_steps=10, schedule="linear"), 100) == pytest.approx(0.5)
    assert lr_at(90, OptimConfig(lr=1.0, warmup_steps=10, schedule="constant"), 100) == 1.0


def test_weight_decay_only_on_matrices_and_embeddings() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    opt = build_optimizer(model, OptimConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and {p.dim() for p in decay["params"]} == {2}
    assert no_decay["weight_decay"] == 0.0 and {p.dim() for p in no_decay["params"]} == {1}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_min_lr_above_lr_is_rejected() -> None:
    with pytest.raises(ValueError, match="optim.min_lr=2.0 is above optim.lr=1.0"):
        OptimConfig(lr=1.0, min_lr=2.0)
