from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.precision import build_precision, check_precision_supported
from trainmesh.precision.amp import ScaledMixedPrecision

CPU = torch.device("cpu")


def test_bf16_mixed_autocasts_matmuls_and_keeps_fp32_weights() -> None:
    precision = build_precision("bf16-mixed", CPU)
    layer = precision.convert_module(torch.nn.Linear(4, 4))
    with precision.autocast():
        out = layer(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16 and layer.weight.dtype == torch.float32


def test_bf16_true_stores_the_model_in_bf16() -> None:
    layer = build_precision("bf16-true", CPU).convert_module(torch.nn.Linear(4, 4))
    assert layer.weight.dtype == torch.bfloat16


def test_unknown_precision_is_rejected() -> None:
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        check_precision_supported("fp8", CPU)


def _step(precision: ScaledMixedPrecision, layer: torch.nn.Linear, opt: torch.optim.Optimizer, poison: bool) -> bool:
    with precision.autocast():
        loss = layer(torch.ones(1, 2)).float().sum()
    precision.backward(loss * (float("inf") if poison else 1.0))
    precision.unscale(opt)
    stepped = precision.step(opt)
    opt.zero_grad()
    return stepped


def test_16_mixed_skips_an_overflowing_step_and_lowers_the_scale() -> None:
    precision = build_precision("16-mixed", CPU)
    assert isinstance(precision, ScaledMixedPrecision)
    layer = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    before = layer.weight.detach().clone()
    scale = precision.scaler.get_scale()
    assert not _step(precision, layer, opt, poison=True)
    assert torch.equal(layer.weight, before) and precision.scaler.get_scale() < scale
    assert _step(precision, layer, opt, poison=False)
    assert not torch.equal(layer.weight, before)
    state = precision.state_dict()
    fresh = build_precision("16-mixed", CPU)
    fresh.load_state_dict(state)
    assert isinstance(fresh, ScaledMixedPrecision) and fresh.scaler.get_scale() == precision.scaler.get_scale()


def test_bf16_true_trains_on_float_inputs(tmp_path: Path) -> None:
    """bf16-true has no autocast: the ResNet recipe's float32 images are cast to the bf16 model's dtype as
    they enter it (found on an H100: "Input type (FloatTensor) and weight type (BFloat16) ...")."""
    tiny = ["--model.width=4", "--model.image_size=16", "--train.max_steps=3", "--train.eval_samples=32"]
    tiny += ["--run.progress=false", "--checkpoint.final=false", f"--run.out_dir={tmp_path}", "--run.id=b"]
    config = load_config(None, [*tiny, "--train.precision=bf16-true"], "resnet")
    result = run_worker(config, tmp_path / "b")
    assert result.steps == 3 and math.isfinite(result.val_loss)
    assert {p.dtype for p in result.model.parameters()} == {torch.bfloat16}
