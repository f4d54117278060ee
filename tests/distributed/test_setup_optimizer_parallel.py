"""The optimizer `rt.setup` (ddp) and `rt.setup_optimizer` (fsdp) return, on 2 gloo ranks under 16-mixed: its plain
`step()` skips an overflow on every rank when only one rank overflowed, takes the steps `rt.step` takes, bit for
bit, and LR schedulers and DCP checkpoints (the project's `rt.state_dicts` and torch's own API) work with it."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.tensor import DTensor

from trainmesh import Runtime
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

INF = float("inf")


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def _backward(rt: Runtime, model: nn.Module, scale: float) -> None:
    x = torch.linspace(-1, 1, 8).reshape(2, 4) * (rt.rank + 1)  # different data per rank
    with rt.autocast():
        loss = model(x).float().pow(2).mean() * 0.01
    rt.backward(loss * scale)


def _build(
    strategy: str, precision: str, how: str
) -> tuple[Runtime, nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """A Runtime (the second one in a process adopts the group) and a model trained by it: `how` is "reference"
    (a plain optimizer stepped by rt.step, as the training loop does) or "setup" (the optimizer setup returned,
    stepped by its own step())."""
    rt = Runtime(strategy=strategy, precision=precision, seed=0)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    if strategy == "ddp" and how == "setup":  # an optimizer built before setup, as most scripts do
        model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    else:
        model = rt.setup(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        if how == "setup":  # fsdp: an optimizer over the shards, built after setup
            optimizer = rt.setup_optimizer(optimizer)
    return rt, model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


def _train(
    rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, how: str, scales: list[float]
) -> list[bool]:
    taken = []
    for scale in scales:
        _backward(rt, model, scale)
        rt.clip_grad_norm(model, optimizer, 1.0)
        if how == "setup":
            optimizer.step()
            taken.append(not optimizer.step_was_skipped)  # type: ignore[attr-defined]
        else:
            taken.append(rt.step(optimizer))
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
    return taken


def optimizer_rank(rank: int, root: str, strategy: str) -> dict[str, Any]:
    precision = "16-mixed"
    refusal = ""
    if strategy == "fsdp":
        rt = Runtime(strategy=strategy, precision=precision)
        try:
            rt.setup(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters()))
        except ValueError as e:
            refusal = str(e)
    # The overflow only on rank 1: ddp all-reduces (fsdp reduce-scatters) the gradients before the check.
    scales = [1.0, INF if rank == 1 else 1.0, 2.0]
    runs = {how: _build(strategy, precision, how) for how in ("reference", "setup")}
    before = _full(runs["setup"][1])
    scale_before = runs["setup"][0].precision.state_dict()["scaler"]["scale"]
    taken = {how: _train(*run, how, scales) for how, run in runs.items()}
    rt, model, optimizer, scheduler = runs["setup"]
    scale_after = rt.precision.state_dict()["scaler"]["scale"]
    result: dict[str, Any] = {
        "refusal": refusal,
        "taken": taken,
        "scale_lowered": scale_after < scale_before,
        "params": _full(model),
        "reference": _full(runs["reference"][1]),
        "moved": not torch.equal(before[0], _full(model)[0]),
        "lr": optimizer.param_groups[0]["lr"],
    }

    # A checkpoint through the project's path (rt.state_dicts, DCP), and DCP handed the returned optimizer.
    model_state, optim_state = rt.state_dicts(model, optimizer)
    direct = get_optimizer_state_dict(model, optimizer)
    result["same_keys"] = sorted(direct["state"]) == sorted(optim_state["state"]) and len(direct["state"]) == 4
    path = Path(root) / strategy
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    saved = copy.deepcopy((scheduler.state_dict(), rt.precision_state()))
    _train(rt, model, optimizer, scheduler, "setup", [1.0, 3.0])

    rt2, model2, optimizer2, scheduler2 = _build(strategy, precision, "setup")
    model_state2, optim_state2 = rt2.state_dicts(model2, optimizer2)  # templates (an empty optimizer: DCP steps it)
    dcp.load({"model": model_state2, "optim": optim_state2}, checkpoint_id=path)
    rt2.load_state_dicts(model2, optimizer2, model_state2, optim_state2)
    scheduler2.load_state_dict(saved[0])
    rt2.load_precision_state(saved[1])
    _train(rt2, model2, optimizer2, scheduler2, "setup", [1.0, 3.0])
    result["resumed_equal"] = all(torch.equal(a, b) for a, b in zip(_full(model2), _full(model), strict=True))
    result["resumed_lr"] = optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    rt.teardown()
    return result


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_returned_optimizer_steps_as_rt_step_on_every_rank(tmp_path: Path, strategy: str) -> None:
    results = run_distributed(optimizer_rank, 2, args=(str(tmp_path), strategy))
    expected = [True, False, True]  # rank 1's overflow skips the step on both ranks
    for r in results:
        assert r["taken"] == {"reference": expected, "setup": expected}
        assert r["scale_lowered"]
        assert r["moved"] and all(torch.isfinite(p).all() for p in r["params"])
        assert all(torch.equal(a, b) for a, b in zip(r["params"], r["reference"], strict=True))  # bit for bit
        assert r["lr"] == pytest.approx(0.1 * 0.5**3)
        assert r["same_keys"] and r["resumed_equal"] and r["resumed_lr"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["params"], results[1]["params"], strict=True))
    if strategy == "fsdp":
        assert "rt.setup_optimizer(optimizer)" in results[0]["refusal"]
