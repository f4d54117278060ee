"""trainmesh.horovod where Horovod's own test file (test/parallel/test_torch.py) found it different, on 2 gloo ranks:
ranks that disagree on a collective get HorovodInternalError on every rank (never a wrong result, an abort or a
hang), Horovod's gradients, int16, integer scaling and averages, alltoall, reducescatter, grouped collectives,
process sets, sparse all-reduce, init after shutdown and the switch that turns the check off.

All checks run in one spawn (a module fixture): each test asserts on its part of the results."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
import torch.distributed as dist

import trainmesh.horovod as hvd
from trainmesh.compat.horovod.handles import Handle
from trainmesh.compat.horovod.ops import finish_reduction
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _error(call: Callable[[], object]) -> str:
    """'Type: message' of what `call` raised ('' when it did not raise)."""
    try:
        call()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _disagreements(rank: int) -> dict[str, str]:
    """Each call differs between the 2 ranks in one thing; every rank must raise, and the next call still works."""
    ones = torch.ones(4)
    return {
        "allreduce_dtype": _error(lambda: hvd.allreduce(ones.int() if rank else ones)),
        "allreduce_shape": _error(lambda: hvd.allreduce(torch.ones(2 + rank, 6))),
        "allreduce_rank_of_shape": _error(lambda: hvd.allreduce(ones.reshape(2, 2) if rank else ones)),
        "allreduce_op": _error(lambda: hvd.allreduce(ones, op=hvd.Sum if rank else hvd.Max)),
        "allreduce_name": _error(lambda: hvd.allreduce(ones, name=f"loss{rank}")),
        "broadcast_dtype": _error(lambda: hvd.broadcast(ones.double() if rank else ones, root_rank=0)),
        "broadcast_shape": _error(lambda: hvd.broadcast(torch.ones(3 + rank), root_rank=0)),
        "broadcast_root": _error(lambda: hvd.broadcast(ones, root_rank=rank)),
        "allgather_dtype": _error(lambda: hvd.allgather(ones.int() if rank else ones)),
        "different_calls": _error(lambda: hvd.allgather(ones) if rank else hvd.allreduce(ones)),
    }


def _sparse_while_joined(rank: int) -> dict[str, Any]:
    """A sparse gradient while rank 1 is inside hvd.join(): rank 0's goes dense, matching the joined rank's zeros
    (gathering it instead aborted a rank), and the optimizer still gets a sparse gradient."""
    model = torch.nn.Embedding(3, 1, sparse=True, _weight=torch.zeros(3, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0))
    if rank == 0:
        model(torch.tensor([0, 2, 2])).sum().backward()
        opt.step()
    last = hvd.join()
    assert model.weight.grad is None or model.weight.grad.is_sparse
    return {"sparse_joined": [model.weight.detach().flatten().tolist(), last]}


def _in_place_on_parameters(rank: int) -> dict[str, Any]:
    """The in-place calls on a parameter (a leaf that requires grad), which autograd forbids changing in place."""
    param = torch.nn.Parameter(torch.full((3,), float(rank + 1)))
    hvd.broadcast_(param, root_rank=0)
    broadcast = param.detach().clone()
    hvd.synchronize(hvd.broadcast_async_(param, root_rank=1))  # rank 1's value is still rank 0's: 1
    hvd.allreduce_(param, op=hvd.Sum)
    return {"param_in_place": [broadcast, param.detach().clone(), param.requires_grad]}


def _optimizer_after_an_error(rank: int) -> dict[str, Any]:
    """A HorovodInternalError inside the optimizer's backward hook (rank 0 steps, rank 1 all-reduces): the
    optimizer forgets the pass, and the next step works on both ranks."""
    layer = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.ones_(layer.weight)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0))
    if rank == 0:
        error = _error(lambda: layer(torch.ones(1, 1)).sum().backward())
    else:
        error = _error(lambda: hvd.allreduce(torch.ones(1)))
    opt.zero_grad()  # raised "zero_grad() ... race condition" when the failed pass was still counted
    layer(torch.full((1, 1), float(rank + 1))).sum().backward()  # gradient: rank + 1
    opt.step()
    return {"optimizer_error": error, "optimizer_after_error": layer.weight.item()}


def _elastic(rank: int) -> dict[str, Any]:
    """hvd.elastic: the state synced from rank 0, commit and restore, a reset on HostsUpdatedInterrupt, the sampler."""
    torch.manual_seed(rank)  # different weights on each rank until the state is synced
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    sampler = hvd.elastic.ElasticSampler(list(range(10)), shuffle=False)
    state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=10 + rank, best=None)
    resets: list[int] = []
    state.register_reset_callbacks([lambda: resets.append(hvd.size())])
    out: dict[str, Any] = {}

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> int:
        out.setdefault("synced", []).append([p.detach().clone() for p in state.model.parameters()])
        if not resets:
            raise hvd.HostsUpdatedInterrupt()  # the script's own: reset, sync again, run again
        state.model(torch.ones(1, 2)).sum().backward()
        state.optimizer.step()
        state.sampler.record_batch(0, 2)  # 2 samples on each of the 2 ranks
        state.epoch += 1
        out["best"] = [state.best]  # a None value is a plain attribute too, as under Horovod
        state.commit()
        committed = [p.detach().clone() for p in state.model.parameters()]
        with torch.no_grad():
            state.model.weight.fill_(100.0)
        state.epoch, state.sampler.processed_num, state.best = 99, 8, 0.5
        state.restore()  # back to the commit
        out["best"].append(state.best)
        out["restored"] = all(torch.equal(a, b) for a, b in zip(committed, state.model.parameters(), strict=True))
        return state.epoch

    out["epoch"] = train(state)
    out["resets"], out["sampler"] = resets, list(sampler)
    return {"elastic": out}


def _names_across_a_barrier(rank: int) -> dict[str, Any]:
    """Horovod's duplicate-name tests: one rank starts named async collectives while the other waits in
    hvd.barrier() (which does not wait for them); a second one of a name in flight raises ValueError on that rank
    alone. Then each rank's deferred collective meets the other's, in call order, with the right result."""
    mine = torch.full((3,), float(rank + 1))
    calls = {
        "allreduce": lambda: hvd.allreduce_async(mine, name="dup", op=hvd.Sum),
        "allgather": lambda: hvd.allgather_async(mine, name="dup"),
        "broadcast": lambda: hvd.broadcast_async(mine, root_rank=0, name="dup"),
        "reducescatter": lambda: hvd.reducescatter_async(mine.reshape(1, 3).expand(2, 3).contiguous(), name="dup"),
    }
    out: dict[str, Any] = {}
    for what, call in calls.items():
        handles, second = [], ""
        for turn in (0, 1):  # rank 0's turn, then rank 1's, the other in a barrier
            if rank == turn:
                handles.append(call())
                second = _error(call)
            hvd.barrier()
        result = hvd.synchronize(handles[0])
        again = _error(lambda call=call: hvd.synchronize(call()))  # the name is free once synchronized
        out[what] = (second, result, again)
    # A call waited for on one rank while the other waits in a barrier: no rank can go on; both raise at once
    out["stuck"] = _error(lambda: hvd.allreduce(mine, name="stuck") if rank == 0 else hvd.barrier())
    out["in_step"] = hvd.allreduce(mine, op=hvd.Sum)
    # Horovod's order-free pattern: rank 0's async call is matched by rank 1's call after rank 0's first barrier,
    # waited for or polled until done (the barrier's rank starts its own deferred call first)
    for key in ("matched", "polled"):
        if rank == 0:
            early = hvd.allreduce_async(mine, name=key, op=hvd.Sum)
            hvd.barrier()
            hvd.barrier()
            out[key] = hvd.synchronize(early)
            continue
        hvd.barrier()
        if key == "matched":  # a blocking call
            out[key] = hvd.allreduce(mine, name=key, op=hvd.Sum)
        else:
            late = hvd.allreduce_async(mine, name=key, op=hvd.Sum)
            while not hvd.poll(late):
                time.sleep(0.01)
            out[key] = hvd.synchronize(late)
        hvd.barrier()
    # many async calls deferred behind the other rank's barrier, run in call order once it arrives
    many = [mine * i for i in range(60)]
    if rank == 0:
        handles = [hvd.allreduce_async(t, name=f"m{i}", op=hvd.Sum) for i, t in enumerate(many)]
        hvd.barrier()
    else:
        hvd.barrier()
        handles = [hvd.allreduce_async(t, name=f"m{i}", op=hvd.Sum) for i, t in enumerate(many)]
    out["many"] = all(torch.equal(hvd.synchronize(h), 3 * t / (rank + 1)) for h, t in zip(handles, many, strict=True))
    return out


def _checks(rank: int) -> dict[str, Any]:
    hvd.init()
    r: dict[str, Any] = {"errors": _disagreements(rank), "names": _names_across_a_barrier(rank)}
    # an argument refused on one rank only: that rank raises its ValueError, the other HorovodInternalError
    r["refused_on_one"] = [
        _error(lambda: hvd.alltoall(torch.ones(4 - rank))),  # rank 1: 3 rows do not split in 2
        _error(lambda: hvd.allgather(torch.tensor(1.0) if rank else torch.ones(1))),  # rank 1: a scalar
        _error(lambda: hvd.broadcast(torch.ones(2), root_rank=5 * rank)),  # rank 1: no rank 5
    ]
    r["after_errors"] = hvd.allreduce(torch.full((2,), float(rank)), op=hvd.Sum)  # the ranks are still in step

    # int16 travels as int32 (gloo has no int16); the result is int16 again
    short = torch.tensor([1, -2, 300], dtype=torch.int16) * (rank + 1)
    r["int16"] = [
        hvd.allreduce(short, op=hvd.Sum),
        hvd.allgather(short),
        hvd.broadcast(short, root_rank=1),
        hvd.alltoall(short[:2]),
        hvd.reducescatter(short[:2], op=hvd.Sum),
    ]
    # integers: an average truncates toward zero; the scale factors apply in float64, then truncate
    r["int_average"] = hvd.allreduce(torch.tensor([-3, 2, -2, 1]) if rank == 0 else torch.tensor([-2, 3, -1, 2]))
    r["int_scaled"] = hvd.allreduce(torch.tensor([3, -3]), op=hvd.Sum, prescale_factor=0.5, postscale_factor=1.5)
    r["int_scaled_average"] = hvd.allreduce(torch.tensor([7, -7], dtype=torch.int32), postscale_factor=0.5)

    # alltoall: equal parts, then splits; the gradient goes back where the rows came from
    r["alltoall"] = hvd.alltoall(torch.arange(4.0) + 10 * rank)
    x = (torch.arange(3.0) + 10 * rank).requires_grad_()
    collected, received = hvd.alltoall(x, torch.tensor([1, 2], dtype=torch.int32))  # rank r sends 1 row to 0
    (collected * (torch.arange(collected.shape[0]) + 1)).sum().backward()
    r["alltoall_splits"], r["alltoall_received"], r["alltoall_grad"] = collected.detach(), received, x.grad
    r["alltoall_errors"] = [
        _error(lambda: hvd.alltoall(torch.ones(3))),  # 3 rows do not split in 2
        _error(lambda: hvd.alltoall(torch.ones(3), torch.tensor([2, 2], dtype=torch.int32))),
        _error(lambda: hvd.alltoall(torch.ones(3), torch.tensor([1.0, 2.0]))),
    ]

    # reducescatter: 5 rows, rank 0 gets 3, rank 1 gets 2; Horovod's gradient: the gathered gradients (x2 for Sum)
    y = (torch.arange(5.0) * (rank + 1)).requires_grad_()
    part = hvd.reducescatter(y, op=hvd.Sum)
    part.sum().backward()
    r["reducescatter"], r["reducescatter_grad"] = part.detach(), y.grad
    r["reducescatter_average"] = hvd.reducescatter(torch.arange(4.0) * (rank + 1))
    r["reducescatter_scalar"] = _error(lambda: hvd.reducescatter(torch.tensor(1.0)))

    # grouped collectives: one handle for all, each tensor its own collective
    pair = [torch.ones(2) * (rank + 1), torch.arange(3.0) * (rank + 1)]
    r["grouped_allreduce_async"] = hvd.synchronize(hvd.grouped_allreduce_async(pair, op=hvd.Sum))
    r["grouped_allgather"] = hvd.grouped_allgather(pair)
    r["grouped_reducescatter"] = hvd.synchronize(hvd.grouped_reducescatter_async([pair[0]], op=hvd.Sum))

    # process sets: every rank adds them; collectives are called by the members only
    singles = [hvd.add_process_set([0]), hvd.add_process_set([1])]
    alone = singles[rank]
    both = hvd.add_process_set(hvd.ProcessSet([1, 0]))
    r["set_alone"] = hvd.allreduce(torch.ones(1) * (rank + 1), op=hvd.Sum, process_set=alone)
    r["set_both"] = hvd.allgather(torch.ones(1) * rank, process_set=both)
    r["set_who"] = [alone.size(), alone.rank(), both.ranks, hvd.global_process_set.size()]
    r["set_object"] = hvd.broadcast_object(f"from {rank}", root_rank=rank, process_set=alone)
    # an optimizer on a set averages over its members; a rank outside it steps alone (rank 1 and set [0])
    steps = []
    for ps in (singles[0], both):
        layer = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(layer.weight)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(layer.parameters(), lr=1.0), process_set=ps)
        layer(torch.full((1, 1), float(rank + 1))).sum().backward()  # gradient: rank + 1
        opt.step()
        steps.append(layer.weight.item())
    r["set_optimizer"] = steps
    subgroup = alone.group
    r["set_removed"] = [hvd.remove_process_set(alone), hvd.remove_process_set(alone)]
    r["set_destroyed"] = _error(lambda: dist.get_process_group_ranks(subgroup))  # torch forgot the subgroup
    r["set_refused"] = _error(lambda: hvd.allreduce(torch.ones(1), process_set=alone))

    # sparse: indices and values gathered; Sum adds the duplicates once made dense
    sparse = torch.sparse_coo_tensor([[rank, 2]], [1.0, 2.0], (3,))
    r["sparse"] = hvd.sparse_allreduce_async(sparse, name="emb", op=hvd.Sum)().to_dense()

    # a DistributedOptimizer over sparse gradients: Horovod's gathered indices and values, or (sparse_as_dense) a
    # dense all-reduce whose result the optimizer gets back as a sparse gradient
    inputs = [torch.tensor([0, 1, 1]), torch.tensor([1, 3])]
    weights = torch.arange(10.0).reshape(5, 2)
    reference = torch.nn.Embedding(5, 2, _weight=weights.clone())  # both ranks' batches, averaged, on one process
    (reference(inputs[0]).sum() + reference(inputs[1]).sum()).div(2).backward()
    assert reference.weight.grad is not None
    r["sparse_optimizer"] = []
    for as_dense in (False, True):
        model = torch.nn.Embedding(5, 2, sparse=True, _weight=weights.clone())
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), sparse_as_dense=as_dense)
        model(inputs[rank]).sum().backward()
        opt.step()
        assert model.weight.grad is not None
        stepped = torch.equal(model.weight.detach(), weights - reference.weight.grad)
        r["sparse_optimizer"].append((stepped, model.weight.grad.is_sparse))

    r.update(_sparse_while_joined(rank))
    r.update(_in_place_on_parameters(rank))
    r.update(_optimizer_after_an_error(rank))
    r.update(_elastic(rank))

    # init after shutdown (Horovod's tests do it around every test), then with the check turned off
    hvd.shutdown()
    r["after_shutdown"] = hvd.is_initialized()
    first = hvd.ProcessSet([0])
    hvd.init(process_sets=[first])  # Horovod's static process sets
    r["reinit"] = hvd.allreduce(torch.ones(1), op=hvd.Sum)
    r["init_set"] = [first.process_set_id is not None, first.size(), first.included()]
    hvd.shutdown()
    os.environ["TRAINMESH_HOROVOD_CHECK"] = "0"
    hvd.init()
    r["unchecked_names"] = _error(lambda: hvd.allreduce(torch.ones(1), name=f"x{rank}"))  # order matches them
    hvd.barrier()
    hvd.shutdown()
    return r


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_checks, 2, timeout_s=90)


def test_ranks_that_disagree_all_raise_horovods_error(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        for key, error in r["errors"].items():
            assert error.startswith("HorovodInternalError: "), (key, error)
            assert "the ranks called different collectives, so none ran" in error, key
        errors = r["errors"]
        assert "rank 0: hvd.allreduce(op=Average, dtype=float32, shape=(4,), device=cpu)" in errors["allreduce_dtype"]
        assert "rank 1: hvd.allreduce(op=Average, dtype=int32, shape=(4,), device=cpu)" in errors["allreduce_dtype"]
        assert "rank 1: hvd.broadcast(dtype=float32, shape=(4,), root_rank=1, device=cpu)" in errors["broadcast_root"]
        assert "rank 1: hvd.allreduce(name='loss1', op=Average" in errors["allreduce_name"]
        assert (
            "rank 0: hvd.allreduce(" in errors["different_calls"]
            and "rank 1: hvd.allgather(" in errors["different_calls"]
        )
        assert torch.equal(r["after_errors"], torch.ones(2))
    assert issubclass(hvd.HorovodInternalError, RuntimeError)


def test_a_name_in_flight_is_refused_and_async_calls_wait_behind_a_barrier(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        names = r["names"]
        assert "no rank can go on (Horovod would hang here)" in names.pop("stuck"), r["names"]
        assert torch.equal(names.pop("in_step"), torch.full((3,), 3.0))  # the ranks are in step again
        assert torch.equal(names.pop("matched"), torch.full((3,), 3.0))
        assert torch.equal(names.pop("polled"), torch.full((3,), 3.0))
        assert names.pop("many") is True
    for rank, r in enumerate(ranks):
        for what, (second, result, again) in r["names"].items():
            assert second.startswith(f"ValueError: hvd.{what}: a collective named 'dup' is still in flight"), second
            assert again == "", (what, again)
            expected = {
                "allreduce": torch.full((3,), 3.0),
                "allgather": torch.cat([torch.full((3,), 1.0), torch.full((3,), 2.0)]),
                "broadcast": torch.full((3,), 1.0),
                "reducescatter": torch.full((1, 3), 1.5),  # the average of rank 0's 1 and rank 1's 2
            }[what]
            assert torch.equal(result, expected), (rank, what, result)


def test_int16_and_integer_scaling_as_horovod(ranks: list[dict[str, Any]]) -> None:
    short = torch.tensor([1, -2, 300], dtype=torch.int16)
    for rank, r in enumerate(ranks):
        summed, gathered, broadcast, exchanged, scattered = r["int16"]
        assert all(t.dtype == torch.int16 for t in r["int16"])
        assert torch.equal(summed, short * 3) and torch.equal(gathered, torch.cat([short, short * 2]))
        assert torch.equal(broadcast, short * 2)
        assert torch.equal(exchanged, torch.tensor([1, 2], dtype=torch.int16) * [1, -2][rank])
        assert torch.equal(scattered, torch.tensor([[3], [-6]], dtype=torch.int16)[rank])
        assert torch.equal(r["int_average"], torch.tensor([-2, 2, -1, 1]))  # (-5, 5, -3, 3) / 2 toward zero
        assert torch.equal(r["int_scaled"], torch.tensor([3, -3]))  # trunc(1.5)=1 on each rank; (1+1) * 1.5
        assert torch.equal(r["int_scaled_average"], torch.tensor([3, -3], dtype=torch.int32))  # 14 * 0.5 / 2


def test_alltoall_and_its_gradient(ranks: list[dict[str, Any]]) -> None:
    assert torch.equal(ranks[0]["alltoall"], torch.tensor([0.0, 1, 10, 11]))
    assert torch.equal(ranks[1]["alltoall"], torch.tensor([2.0, 3, 12, 13]))
    assert torch.equal(ranks[0]["alltoall_splits"], torch.tensor([0.0, 10]))
    assert torch.equal(ranks[1]["alltoall_splits"], torch.tensor([1.0, 2, 11, 12]))
    assert ranks[0]["alltoall_received"].tolist() == [1, 1] and ranks[1]["alltoall_received"].tolist() == [2, 2]
    # rank 0 weighted its rows 1, 2 (one from each rank); rank 1 weighted its 4 rows 1..4
    assert torch.equal(ranks[0]["alltoall_grad"], torch.tensor([1.0, 1, 2]))
    assert torch.equal(ranks[1]["alltoall_grad"], torch.tensor([2.0, 3, 4]))
    for r in ranks:
        multiple, too_many, float_splits = r["alltoall_errors"]
        assert multiple.startswith("ValueError: hvd.alltoall: dimension 0 (3) is not a multiple of the 2 ranks")
        assert "sum to more than dimension 0 (3)" in too_many and "must be an int32 tensor" in float_splits


def test_reducescatter_splits_as_horovod(ranks: list[dict[str, Any]]) -> None:
    assert torch.equal(ranks[0]["reducescatter"], torch.tensor([0.0, 3, 6]))
    assert torch.equal(ranks[1]["reducescatter"], torch.tensor([9.0, 12]))
    assert torch.equal(ranks[0]["reducescatter_average"], torch.tensor([0.0, 1.5]))
    for r in ranks:
        assert torch.equal(r["reducescatter_grad"], torch.full((5,), 2.0))
        assert r["reducescatter_scalar"].startswith("ValueError: hvd.reducescatter: a scalar")


def test_grouped_collectives(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert [t.tolist() for t in r["grouped_allreduce_async"]] == [[3.0, 3.0], [0.0, 3.0, 6.0]]
        assert [t.tolist() for t in r["grouped_allgather"]] == [[1.0, 1, 2, 2], [0.0, 1, 2, 0, 2, 4]]
    assert [t.tolist() for t in ranks[1]["grouped_reducescatter"]] == [[3.0]]


def test_process_sets(ranks: list[dict[str, Any]]) -> None:
    assert [r["set_alone"].item() for r in ranks] == [1.0, 2.0]  # each rank alone in its set
    assert [r["set_object"] for r in ranks] == ["from 0", "from 1"]
    assert [r["set_optimizer"] for r in ranks] == [[0.0, -0.5], [-1.0, -0.5]]  # 1 - grad; 1 - (1 + 2) / 2
    for r in ranks:
        assert torch.equal(r["set_both"], torch.tensor([0.0, 1.0]))
        assert r["set_who"] == [1, 0, [0, 1], 2] and r["set_removed"] == [True, False]
        assert "is not registered" in r["set_refused"] and r["set_destroyed"].startswith("KeyError")


def test_sparse_allreduce_init_after_shutdown_and_the_switch(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["sparse"], torch.tensor([1.0, 1.0, 4.0]))
        assert r["sparse_optimizer"] == [(True, True), (True, True)]
        assert r["after_shutdown"] is False and torch.equal(r["reinit"], torch.tensor([2.0]))
        assert r["unchecked_names"] == ""  # TRAINMESH_HOROVOD_CHECK=0: no agreement round
    assert [r["init_set"] for r in ranks] == [[True, 1, True], [True, 1, False]]


def test_an_argument_refused_on_one_rank_raises_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    for error in ranks[1]["refused_on_one"]:
        assert error.startswith("ValueError: hvd."), error
    for error in ranks[0]["refused_on_one"]:
        assert error.startswith("HorovodInternalError: hvd."), error
        assert "the arguments were refused on 1 of 2 ranks" in error


def test_sparse_gradients_while_a_rank_is_joined(ranks: list[dict[str, Any]]) -> None:
    # rank 0's gradient [1, 0, 2] averaged with rank 1's zeros; join() returns the rank that joined last
    assert ranks[0]["sparse_joined"] == [[-0.5, 0.0, -1.0], 0]
    assert ranks[1]["sparse_joined"] == [[0.0, 0.0, 0.0], 0]


def test_in_place_calls_on_a_parameter(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        broadcast, reduced, requires_grad = r["param_in_place"]
        assert torch.equal(broadcast, torch.ones(3)) and torch.equal(reduced, torch.full((3,), 2.0))
        assert requires_grad


def test_optimizer_recovers_from_an_error_in_its_hook(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["optimizer_error"].startswith("HorovodInternalError: "), r["optimizer_error"]
        assert r["optimizer_after_error"] == -0.5  # 1 - (1 + 2) / 2


def test_integer_average_divides_after_scaling() -> None:
    # 49 * (1 / 49) is 0.999..., which truncated to 0; 49 * 1 / 49 is exactly 1
    summed = torch.tensor([49, -98, 50], dtype=torch.int32)
    assert torch.equal(finish_reduction(summed, hvd.Average, 49, 1.0), torch.tensor([1, -2, 1], dtype=torch.int32))


def test_a_handle_finishes_once_across_threads() -> None:
    calls: list[int] = []
    handle = Handle([], lambda: calls.append(1) or len(calls))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: handle.wait(), range(8)))
    assert calls == [1] and results == [1] * 8


def test_elastic_state_run_and_sampler(ranks: list[dict[str, Any]]) -> None:
    first, second = (r["elastic"] for r in ranks)
    for ours, theirs in zip(first["synced"], second["synced"], strict=True):  # rank 0's weights, twice
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))
    for e in (first, second):
        assert e["epoch"] == 11 and e["restored"] and e["resets"] == [2]  # rank 0's epoch 10, plus one
        assert e["best"] == [None, None]
    assert first["sampler"] == [4, 6, 8] and second["sampler"] == [5, 7, 9]  # 4 of 10 processed
