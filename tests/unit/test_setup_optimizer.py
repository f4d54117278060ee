"""The optimizer `rt.setup` returns (runtime/optimizer.py): its plain `step()` is `rt.step`, so under 16-mixed an
overflowing step is skipped; otherwise it is the user's optimizer (isinstance, state, LR schedulers, checkpoints)."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

from trainmesh.config.schema import DistConfig
from trainmesh.runtime.optimizer import unwrap_optimizer
from trainmesh.runtime.runtime import Runtime

INF = float("inf")


def _runtime(precision: str) -> Runtime:
    return Runtime(strategy="single", precision=precision, dist_config=DistConfig(device="cpu"), seed=0)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _backward(rt: Runtime, model: nn.Module, scale: float = 1.0) -> None:
    x = torch.linspace(-1, 1, 8, device=rt.device).reshape(2, 4)
    with rt.autocast():
        loss = model(x).float().pow(2).mean() * 0.01  # small: no fp16 overflow at the initial loss scale
    rt.backward(loss * scale)


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _halving(step: int) -> float:
    return 0.5**step


def test_optimizer_step_skips_an_overflow_under_16_mixed() -> None:
    rt = _runtime("16-mixed")
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    before, scale = _params(model), rt.precision.scaler.get_scale()  # type: ignore[attr-defined]
    _backward(rt, model, INF)
    assert optimizer.step() is None  # torch's convention: no closure, no loss
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))  # finite, as they were
    assert rt.precision.scaler.get_scale() < scale  # type: ignore[attr-defined]
    assert optimizer.step_was_skipped  # type: ignore[attr-defined]
    optimizer.zero_grad()
    _backward(rt, model)
    optimizer.step()
    assert not optimizer.step_was_skipped  # type: ignore[attr-defined]
    after = _params(model)
    assert all(torch.isfinite(p).all() for p in after) and not torch.equal(after[0], before[0])


def _train(precision: str, how: str) -> tuple[list[torch.Tensor], list[bool], int]:
    """Four steps (the second overflows under 16-mixed) with clipping on the last two; `how`: "reference" (an
    optimizer built after setup, stepped by rt.step, as the training loop does), "optimizer.step()" or "rt.step"
    on the optimizer setup returned. Returns the parameters, whether each step was taken, and the optimizer's
    own step calls."""
    rt = _runtime(precision)
    net = _net()
    if how == "reference":
        model = rt.setup(net)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))
    calls = [0]
    optimizer.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    taken = []
    for i, scale in enumerate([1.0, INF if precision == "16-mixed" else 2.0, 1.0, 3.0]):
        _backward(rt, model, scale)
        if i >= 2:
            rt.clip_grad_norm(model, optimizer, 0.1)  # unscales first: the step must not unscale again
        if how == "optimizer.step()":
            optimizer.step()
            taken.append(not optimizer.step_was_skipped)  # type: ignore[attr-defined]
        else:
            taken.append(rt.step(optimizer))
        optimizer.zero_grad(set_to_none=True)
    return _params(model), taken, calls[0]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "16-mixed"])
def test_optimizer_step_equals_rt_step(precision: str) -> None:
    reference, taken, calls = _train(precision, "reference")
    assert taken == [True, precision != "16-mixed", True, True] and calls == sum(taken)
    for how in ("optimizer.step()", "rt.step"):  # the same arithmetic, each step taken or skipped once
        params, how_taken, how_calls = _train(precision, how)
        assert (how_taken, how_calls) == (taken, calls), how
        assert all(torch.equal(a, b) for a, b in zip(params, reference, strict=True)), how


def _steps(
    rt: Runtime, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scales: list[float]
) -> None:
    for scale in scales:
        _backward(rt, model, scale)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def _setup(rt: Runtime, lr_lambda: Callable[[int], float]) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)


def test_lr_scheduler_and_checkpoints_work_on_the_returned_optimizer() -> None:
    rt = _runtime("16-mixed")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        model, optimizer, scheduler = _setup(rt, _halving)
        assert isinstance(optimizer, torch.optim.AdamW)
        _steps(rt, model, optimizer, scheduler, [1.0, INF, 1.0])
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**3)
    assert all(torch.isfinite(p).all() for p in model.parameters())

    model_state, optim_state = copy.deepcopy(rt.state_dicts(model, optimizer))  # the checkpoint code's path
    direct = copy.deepcopy(get_optimizer_state_dict(model, optimizer))  # DCP handed the returned optimizer
    assert direct["state"].keys() == optim_state["state"].keys() and len(direct["state"]) == 4
    saved = copy.deepcopy((optimizer.state_dict(), scheduler.state_dict(), rt.precision_state()))
    _steps(rt, model, optimizer, scheduler, [1.0, 2.0])

    for path in ("rt.load_state_dicts", "load_state_dict", "set_optimizer_state_dict"):
        fresh = _runtime("16-mixed")
        model2, optimizer2, scheduler2 = _setup(fresh, _halving)
        if path == "rt.load_state_dicts":
            fresh.load_state_dicts(model2, optimizer2, model_state, copy.deepcopy(optim_state))
        else:
            model2.load_state_dict(model_state)
        if path == "load_state_dict":
            optimizer2.load_state_dict(saved[0])
            assert optimizer2.state is unwrap_optimizer(optimizer2).state  # loaded into the user's optimizer
        elif path == "set_optimizer_state_dict":  # into an optimizer without state: DCP steps it once, lr 0
            set_optimizer_state_dict(model2, optimizer2, direct)
        scheduler2.load_state_dict(saved[1])
        fresh.load_precision_state(saved[2])
        _steps(fresh, model2, optimizer2, scheduler2, [1.0, 2.0])
        assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"], path
        assert all(torch.equal(a, b) for a, b in zip(_params(model2), _params(model), strict=True)), path


def test_the_returned_optimizer_is_the_users_own() -> None:
    rt = _runtime("16-mixed")
    net = _net()
    inner = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = rt.setup(net, inner)
    assert isinstance(optimizer, torch.optim.SGD) and optimizer is not inner
    assert optimizer.param_groups is inner.param_groups and optimizer.state is inner.state
    assert optimizer.defaults is inner.defaults and repr(optimizer) == repr(inner)
    optimizer.custom = 1  # type: ignore[attr-defined]  # data lives on the user's optimizer
    assert inner.custom == 1  # type: ignore[attr-defined]
    extra = nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [extra], "lr": 0.5})
    assert len(inner.param_groups) == 2 and inner.param_groups[1]["momentum"] == 0.9

    # Set up again (by this Runtime): the same optimizer, stepped once per step; by another: the user's, afresh.
    assert rt.setup(model, optimizer)[1] is optimizer and rt.setup_optimizer(optimizer) is optimizer
    assert type(rt.setup_optimizer(inner)) is type(optimizer)
    other = _runtime("16-mixed").setup_optimizer(optimizer)
    assert other is not optimizer and unwrap_optimizer(other) is inner
    calls = [0]
    inner.register_step_post_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    _backward(rt, model)
    extra.grad = torch.full((3,), rt.precision.scaler.get_scale())  # type: ignore[attr-defined]  # as if scaled
    rt.clip_grad_norm(model, optimizer, 1.0)
    assert rt.step(optimizer) and calls == [1] and not optimizer.step_was_skipped  # type: ignore[attr-defined]
    assert torch.equal(extra.detach(), torch.full((3,), 0.5))  # 1 - lr 0.5 * the unscaled gradient 1
    optimizer.zero_grad()
    assert all(p.grad is None for group in inner.param_groups for p in group["params"])

    with pytest.raises(ValueError, match="takes no closure"):  # GradScaler's step cannot unscale its loss
        optimizer.step(lambda: 1.5)

    # A copy is of the user's optimizer alone (the Runtime does not travel); setup_optimizer guards it again.
    for duplicate in (copy.deepcopy(optimizer), pickle.loads(pickle.dumps(optimizer)), copy.copy(optimizer)):
        assert type(duplicate) is torch.optim.SGD
        assert duplicate.state_dict()["param_groups"] == inner.state_dict()["param_groups"]
    assert rt.setup_optimizer(copy.deepcopy(optimizer)).step_was_skipped is False  # type: ignore[attr-defined]


def test_setup_refuses_what_is_not_an_optimizer() -> None:
    rt = _runtime("32-true")
    with pytest.raises(TypeError, match=r"rt.setup \(or rt.setup_optimizer\) is a list, not a torch.optim.Optimizer"):
        rt.setup(_net(), [])  # type: ignore[call-overload]


@pytest.mark.gpu
def test_dp_returns_the_guarded_optimizer_too() -> None:
    """parallel.strategy=dp (nn.DataParallel, CUDA only) takes the optimizer in setup as well."""
    rt = Runtime(strategy="dp", precision="16-mixed", seed=0)
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=0.1))
    before = _params(model)
    _backward(rt, model, INF)
    optimizer.step()
    assert optimizer.step_was_skipped  # type: ignore[attr-defined]
    assert all(torch.equal(a, b) for a, b in zip(_params(model), before, strict=True))
    optimizer.zero_grad()
    _backward(rt, model)
    assert rt.step(optimizer) and not torch.equal(_params(model)[0], before[0])
    model_state, optim_state = copy.deepcopy(rt.state_dicts(model, optimizer))
    net2 = _net()
    model2, optimizer2 = rt.setup(net2, torch.optim.AdamW(net2.parameters(), lr=0.1))
    rt.load_state_dicts(model2, optimizer2, model_state, optim_state)
    assert all(torch.equal(a, b) for a, b in zip(_params(model2), _params(model), strict=True))
    assert optimizer2.state_dict()["state"].keys() == optimizer.state_dict()["state"].keys()


def test_a_second_optimizer_after_one_backward_is_refused_under_16_mixed_and_steps_elsewhere() -> None:
    """The scaler updates its scale once per step: a second optimizer's gradients would be unscaled by another
    scale than they were scaled with (and, clipped first, twice). Refused with the fix; other precisions step it."""
    for precision in ("32-true", "16-mixed"):
        rt = _runtime(precision)
        net = _net()
        first, second = list(net.parameters())[:2], list(net.parameters())[2:]
        model, one = rt.setup(net, torch.optim.SGD(first, lr=0.1))
        two = rt.setup_optimizer(torch.optim.SGD(second, lr=0.1))
        _backward(rt, model)
        one.step()
        if precision == "16-mixed":
            with pytest.raises(ValueError, match="one optimizer with parameter groups"):
                two.step()
        else:
            before = _params(model)
            rt.step(two)
            assert not torch.equal(_params(model)[-1], before[-1])


def test_an_optimizer_that_calls_its_closure_again_gets_it() -> None:
    rt = _runtime("32-true")
    net = _net()
    model, optimizer = rt.setup(net, torch.optim.LBFGS(net.parameters(), lr=0.5, max_iter=3))
    calls = []

    def closure() -> float:
        optimizer.zero_grad()
        _backward(rt, model)
        calls.append(1)
        return 1.5

    assert optimizer.step(closure) == 1.5 and len(calls) > 1
