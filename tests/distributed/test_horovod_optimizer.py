"""hvd.DistributedOptimizer, broadcast_optimizer_state and join on 2 gloo ranks, against a reference that each
rank computes alone: the same model trained on both ranks' batches, their gradients combined with the
all-reduce's arithmetic ((g0 + g1) / 2). Bit-exact wherever the arithmetic is the same: averaging,
backward_passes_per_step=2 against accumulating 2 micro-batches, fp16 compression against the same sum in
float16, the synchronize/clip/skip_synchronize pattern, a parameter without gradient on one rank, and a
rank that joins early (it contributes zeros). All checks run in one spawn (a module fixture)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import trainmesh.horovod as hvd
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

STEPS = 3
Grads = list[torch.Tensor]


def _model(heads: int = 1) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank and in the reference
    layers = [nn.Linear(5, 8), nn.Tanh(), *[nn.Linear(8, 3) for _ in range(heads)]]
    return nn.Sequential(*layers)


def _loss(model: nn.Module, rank: int, step: int, micro: int = 0, heads: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + micro)
    x, y = torch.randn(4, 5, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    hidden = model[1](model[0](x))
    return sum(F.cross_entropy(model[2 + h](hidden), y) for h in range(heads))  # type: ignore[return-value]


def _grads(model: nn.Module, losses: list[Callable[[], torch.Tensor]]) -> Grads:
    """One rank's gradient: its micro-batches' backward passes accumulated (zeros where none reached)."""
    model.zero_grad(set_to_none=True)
    for loss in losses:
        loss().backward()
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def _reference(
    combine: Callable[[Grads, Grads], Grads], micro: int = 1, heads: tuple[int, int] = (1, 1), clip: float = 0.0
) -> list[torch.Tensor]:
    """STEPS steps of SGD on both ranks' batches, their gradients combined by `combine` (in one process)."""
    model = _model(max(heads))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        per_rank = [
            _grads(model, [lambda r=r, m=m, s=step: _loss(model, r, s, m, heads[r]) for m in range(micro)])
            for r in (0, 1)
        ]
        for p, g in zip(model.parameters(), combine(*per_rank), strict=True):
            p.grad = g
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _average(g0: Grads, g1: Grads) -> Grads:
    return [(a + b).div(2) for a, b in zip(g0, g1, strict=True)]  # all_reduce(SUM), then / hvd.size()


def _train(
    rank: int, micro: int = 1, heads: int = 1, clip: float = 0.0, log_loss: bool = False, **kwargs: Any
) -> list[torch.Tensor]:
    model = _model(heads)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), **kwargs)
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(micro):
            loss = _loss(model, rank, step, m, heads if rank == 1 else 1)  # rank 0 never uses the 2nd head
            loss.backward()
            if log_loss:  # a collective between backward and step: after the gradients' all-reduces everywhere
                hvd.allreduce(loss.detach(), name="loss")
        if clip:
            opt.synchronize()
            nn.utils.clip_grad_norm_(model.parameters(), clip)
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _raised(call: Callable[[], Any]) -> str:
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _checks(rank: int) -> dict[str, Any]:
    hvd.init()
    r: dict[str, Any] = {"plain": _train(rank, log_loss=True)}
    r["accumulated"] = _train(rank, micro=2, log_loss=True, backward_passes_per_step=2)
    r["fp16"] = _train(rank, compression=hvd.Compression.fp16)
    r["clipped"] = _train(rank, clip=0.05)
    r["no_grad_on_rank0"] = _train(rank, heads=2)
    r["sum"] = _train(rank, op=hvd.Sum)
    r["predivided"] = _train(rank, gradient_predivide_factor=4.0)

    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    r["classes"] = [isinstance(opt, torch.optim.SGD), isinstance(opt, torch.optim.Optimizer), type(opt).__name__]
    r["shares_groups"] = opt.param_groups[0] is base.param_groups[0]
    unnamed = hvd.DistributedOptimizer(torch.optim.SGD([{"params": [p]} for p in model.parameters()], lr=0.1))
    r["names"] = sorted(set(unnamed._parameter_names.values())), len(list(model.parameters()))
    _loss(model, rank, 0).backward()
    r["started_in_backward"] = opt._hvd_next  # all-reduces started by the hooks, before synchronize()
    r["zero_grad_race"] = _raised(opt.zero_grad)
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()  # after synchronize() without skip_synchronize(): Horovod's warning
    r["warning"] = [str(w.message) for w in caught]
    r["state_dict"] = sorted(opt.state_dict()) == ["param_groups", "state"] and len(opt.state_dict()["state"]) == 4
    opt.zero_grad()
    for _ in range(2):  # backward_passes_per_step=1: a second pass before step() is refused
        r["too_many_passes"] = _raised(lambda: _loss(model, rank, 1).backward())
    opt.synchronize()
    r["refused"] = {
        "adasum": _raised(lambda: hvd.DistributedOptimizer(base, op=hvd.Adasum)),
        "min": _raised(lambda: hvd.DistributedOptimizer(base, op=hvd.Min)),
        "predivide_sum": _raised(lambda: hvd.DistributedOptimizer(base, op=hvd.Sum, gradient_predivide_factor=2)),
        "unnamed": _raised(lambda: hvd.DistributedOptimizer(base, list(model.named_parameters())[:2])),
        "duplicates": _raised(lambda: hvd.DistributedOptimizer(base, [("w", p) for p in model.parameters()])),
        "passes": _raised(lambda: hvd.DistributedOptimizer(base, backward_passes_per_step=0)),
    }
    r.update(_optimizer_state(rank))
    r.update(_join(rank))
    return r


def _optimizer_state(rank: int) -> dict[str, Any]:
    """Rank 0's Adam has stepped; rank 1's has no state yet (created lazily on a first step)."""
    model = _model()
    if rank == 0:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, betas=(0.8, 0.99))
        for step in range(2):
            opt.zero_grad()
            _loss(model, 0, step).backward()
            opt.step()
    else:
        opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    state = [{k: v.clone() for k, v in opt.state[p].items()} for p in model.parameters()]
    out: dict[str, Any] = {
        "adam_state": state,
        "adam_options": (opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]),
    }

    fresh = _model()  # both ranks fresh, wrapped: state from one zero-gradient step, without an all-reduce
    before = [p.detach().clone() for p in fresh.parameters()]
    wrapped = hvd.DistributedOptimizer(torch.optim.Adam(fresh.parameters(), lr=1e-3), fresh.named_parameters())
    hvd.broadcast_optimizer_state(wrapped, root_rank=1)
    out["fresh_steps"] = [float(wrapped.state[p]["step"]) for p in fresh.parameters()]
    out["fresh_unmoved"] = all(torch.equal(a, b) for a, b in zip(before, fresh.parameters(), strict=True))
    wrapped.zero_grad()  # the zero-gradient step left nothing in flight

    other = _model()
    mismatched = torch.optim.Adam(other.parameters()) if rank == 0 else torch.optim.SGD(other.parameters(), 0.1, 0.9)
    out["mismatch"] = _raised(lambda: hvd.broadcast_optimizer_state(mismatched, root_rank=0))
    return out


def _join(rank: int) -> dict[str, Any]:
    """Rank 0 has 2 batches, rank 1 has 4: rank 0 joins early and answers rank 1's all-reduces with zeros."""
    model = _model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters())
    out: dict[str, Any] = {}
    for step in range(2 if rank == 0 else 4):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
    if rank == 1:  # while rank 0 is inside join(): all-reduces work, other collectives raise (as Horovod's)
        out["metric_during_join"] = hvd.allreduce(torch.tensor([3.0]))
        out["allgather_during_join"] = _raised(lambda: hvd.allgather(torch.ones(1)))
    out["last"] = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=out["last"])
    out["joined"] = [p.detach().clone() for p in model.parameters()]
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_checks, 2, timeout_s=100)


def _assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_averaged_gradients_equal_the_reference_bit_exactly(ranks: list[dict[str, Any]]) -> None:
    want = _reference(_average)
    for r in ranks:
        _assert_equal(r["plain"], want)
        _assert_equal(r["sum"], _reference(lambda g0, g1: [a + b for a, b in zip(g0, g1, strict=True)]))
        for a, b in zip(r["predivided"], want, strict=True):  # (g0/4 + g1/4) / 2 * 4: equal up to rounding
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_backward_passes_per_step_equals_accumulating_micro_batches(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _assert_equal(r["accumulated"], _reference(_average, micro=2))


def test_fp16_compression_sums_in_float16(ranks: list[dict[str, Any]]) -> None:
    def fp16(g0: Grads, g1: Grads) -> Grads:
        return [(a.half() + b.half()).div(2).float() for a, b in zip(g0, g1, strict=True)]

    exact = _reference(_average)
    for r in ranks:
        _assert_equal(r["fp16"], fp16_want := _reference(fp16))
        for a, b in zip(fp16_want, exact, strict=True):  # float16's rounding of the gradients, 3 steps on
            assert torch.allclose(a, b, rtol=0, atol=1e-3)
        assert not all(torch.equal(a, b) for a, b in zip(fp16_want, exact, strict=True))


def test_synchronize_clip_skip_synchronize(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _assert_equal(r["clipped"], _reference(_average, clip=0.05))
        assert r["warning"][0].startswith("optimizer.step() called without optimizer.skip_synchronize()")


def test_a_parameter_without_gradient_on_one_rank_takes_part_with_zeros(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        _assert_equal(r["no_grad_on_rank0"], _reference(_average, heads=(1, 2)))


def test_the_wrapper_is_the_optimizers_class_and_refuses_what_horovod_refuses(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert r["classes"] == [True, True, "SGD"] and r["shares_groups"] and r["state_dict"]
    names, count = r["names"]  # Horovod's _parameter_names: one name per parameter, the same on every rank
    assert all(other["names"] == r["names"] for other in ranks)
    assert len(names) == count and names == [f"allreduce.noname.{i}" for i in range(count)]
    assert r["started_in_backward"] == 4  # every parameter's all-reduce overlapped backward
    assert r["zero_grad_race"].startswith("AssertionError: optimizer.zero_grad() was called after loss.backward()")
    assert r["too_many_passes"].startswith("AssertionError: Gradients were computed more than backward_passes_per_step")
    refused = r["refused"]
    assert "Adasum is not supported" in refused["adasum"] and "Fix: op=hvd.Average" in refused["adasum"]
    assert "hvd.Average or hvd.Sum" in refused["min"]
    assert refused["predivide_sum"] == "ValueError: gradient_predivide_factor not supported with op != Average"
    assert "2 of the optimizer's 4 parameters were not named" in refused["unnamed"]
    assert "Found duplicates: w" in refused["duplicates"] and "must be a whole number" in refused["passes"]


def test_broadcast_optimizer_state_with_lazily_created_adam_state(ranks: list[dict[str, Any]]) -> None:
    root, other = ranks[0], ranks[1]
    assert other["adam_options"] == root["adam_options"] == (1e-2, (0.8, 0.99))
    for mine, theirs in zip(other["adam_state"], root["adam_state"], strict=True):
        assert sorted(mine) == ["exp_avg", "exp_avg_sq", "step"]
        assert all(torch.equal(mine[k], theirs[k]) for k in mine) and float(mine["step"]) == 2.0
    for r in ranks:  # fresh on both: Horovod's zero-gradient step, which moves no weight of Adam
        assert r["fresh_steps"] == [1.0] * 4 and r["fresh_unmoved"]
        assert "does not have rank 0's structure" in r["mismatch"] and r["mismatch"].startswith("ValueError")


def test_join_with_uneven_batches(ranks: list[dict[str, Any]]) -> None:
    def step_with_zeros_from_rank0(step: int) -> Callable[[Grads, Grads], Grads]:
        return _average if step < 2 else lambda g0, g1: _average([torch.zeros_like(g) for g in g0], g1)

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        per_rank = [_grads(model, [lambda r=r, s=step: _loss(model, r, s)]) for r in (0, 1)]
        for p, g in zip(model.parameters(), step_with_zeros_from_rank0(step)(*per_rank), strict=True):
            p.grad = g
        opt.step()
    want = [p.detach().clone() for p in model.parameters()]
    assert [r["last"] for r in ranks] == [1, 1]
    for r in ranks:  # rank 1's weights after 4 steps (2 of them with rank 0's zeros), broadcast to rank 0
        _assert_equal(r["joined"], want)
    assert torch.equal(ranks[1]["metric_during_join"], torch.tensor([1.5]))  # (0 + 3) / hvd.size()
    assert ranks[1]["allgather_during_join"].startswith("RankJoinedError: hvd.allgather: 1 of 2 ranks have called")
