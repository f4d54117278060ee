"""trainmesh.horovod's collectives on 2 gloo ranks, against what each rank can compute alone: allreduce (every op,
in place or not, async handles, integer averages, autograd), allgather with different first dimensions,
broadcasts and objects; the same calls in one plain process (world size 1, no torchrun variables); and the
errors Horovod raises, before init and for refused options.

All ranks' checks run in one spawn (a module fixture): each test asserts on its part of the results."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

import trainmesh.horovod as hvd
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _errors(calls: dict[str, Any]) -> dict[str, str]:
    """Each call's exception as 'Type: message' ('' when it did not raise)."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = ""
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _checks(rank: int) -> dict[str, Any]:
    hvd.init()
    hvd.init()  # a second call does nothing, as Horovod's
    r: dict[str, Any] = {
        "who": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()],
        "built": [hvd.gloo_built(), hvd.gloo_enabled(), hvd.mpi_built(), hvd.mpi_threads_supported()],
    }
    mine = torch.full((2, 3), float(rank + 1))  # rank 0: 1.0, rank 1: 2.0
    r["average"] = hvd.allreduce(mine, name="avg")
    r["sum"] = hvd.allreduce(mine, op=hvd.Sum)
    r["min"], r["max"] = hvd.allreduce(mine, op=hvd.Min), hvd.allreduce(mine, op=hvd.Max)
    r["product"] = hvd.allreduce(mine, op=hvd.Product)
    r["deprecated_average_false"] = hvd.allreduce(mine, average=False)
    r["scaled"] = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
    r["input_untouched"] = bool((mine == rank + 1).all())
    r["int_average"] = hvd.allreduce(torch.tensor([rank + 1, 7 * rank, -3 * rank], dtype=torch.int64))  # (1+2)/2, ...
    inplace = mine.clone()
    r["inplace_is_same"] = hvd.allreduce_(inplace, op=hvd.Sum) is inplace
    r["inplace"] = inplace
    handle = hvd.allreduce_async(mine, op=hvd.Sum)
    r["poll_type"] = type(hvd.poll(handle)).__name__
    r["async"] = hvd.synchronize(handle)
    r["poll_after"] = hvd.poll(handle)
    inplace_async = mine.clone()
    r["async_inplace"] = hvd.synchronize(hvd.allreduce_async_(inplace_async)) is inplace_async
    r["grouped"] = hvd.grouped_allreduce([mine, 2 * mine], op=hvd.Sum)
    r["fp16_compressed"] = hvd.allreduce(mine / 3, compression=hvd.Compression.fp16)

    # autograd: y = sum over ranks of x -> dL/dx = sum over ranks of dL/dy = 2 per element
    x = torch.ones(3, requires_grad=True)
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    r["allreduce_grad"] = x.grad

    rows = rank + 2  # rank 0: 2 rows, rank 1: 3 rows
    r["allgather"] = hvd.allgather(torch.full((rows, 2), float(rank)))
    gathered_async = hvd.allgather_async(torch.arange(rows * 2, dtype=torch.int32).reshape(rows, 2))
    r["allgather_async"] = hvd.synchronize(gathered_async)
    g = torch.full((rows, 2), float(rank), requires_grad=True)
    (hvd.allgather(g) * torch.arange(5.0).unsqueeze(1)).sum().backward()
    r["allgather_grad"] = g.grad  # the weights of this rank's rows, averaged over the 2 ranks (Horovod's)
    wrong = torch.zeros(2, 3 + rank)  # trailing dimensions differ: refused on both ranks
    r["errors"] = _errors(
        {
            "trailing": lambda: hvd.allgather(wrong),
            "scalar": lambda: hvd.allgather(torch.tensor(1.0)),
            "both_ops": lambda: hvd.allreduce(mine, average=True, op=hvd.Sum),
            "adasum": lambda: hvd.allreduce(mine, op=hvd.Adasum),
            "root": lambda: hvd.broadcast(mine, root_rank=2),
            "process_set": lambda: hvd.allreduce(mine, process_set="evens"),
            "not_contiguous": lambda: hvd.allreduce_(torch.zeros(3, 4).t()),
            "comm": lambda: hvd.init(comm=[0, 1]),
            "timeline": lambda: hvd.start_timeline("/tmp/timeline.json"),
        }
    )
    r["global_process_set"] = hvd.allreduce(mine, op=hvd.Sum, process_set=hvd.global_process_set)

    r["broadcast"] = hvd.broadcast(mine, root_rank=1)
    r["broadcast_input_untouched"] = bool((mine == rank + 1).all())
    target = mine.clone()
    hvd.broadcast_(target, root_rank=1)
    r["broadcast_"] = target
    r["broadcast_async"] = hvd.synchronize(hvd.broadcast_async(mine, root_rank=0))
    b = torch.full((2,), float(rank), requires_grad=True)
    (hvd.broadcast(b, root_rank=1) * 3).sum().backward()
    r["broadcast_grad"] = b.grad  # root: the 2 ranks' gradients averaged (3, Horovod's); others: 0
    r["broadcast_object"] = hvd.broadcast_object({"rank": rank, "list": [rank] * (rank + 1)}, root_rank=1)
    r["allgather_object"] = hvd.allgather_object(("from", rank, "x" * (100 * rank)))
    torch.manual_seed(rank)  # different weights on each rank until broadcast
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    r["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    other = nn.Linear(4, 2)
    hvd.broadcast_parameters(list(other.named_parameters()), root_rank=1)
    r["named_parameters"] = [p.detach().clone() for p in other.parameters()]
    hvd.barrier()
    hvd.shutdown()
    r["after_shutdown"] = hvd.is_initialized()
    return r


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_checks, 2, timeout_s=90)


def test_init_and_who_am_i(ranks: list[dict[str, Any]]) -> None:
    assert [r["who"] for r in ranks] == [[0, 2, 0, 2, 0, 1], [1, 2, 1, 2, 0, 1]]
    assert ranks[0]["built"] == [True, True, False, False]
    assert [r["after_shutdown"] for r in ranks] == [False, False]


def test_allreduce_ops_in_place_and_async(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:  # every rank has the result
        assert torch.equal(r["average"], torch.full((2, 3), 1.5))
        for key in ("sum", "deprecated_average_false", "inplace", "async", "global_process_set"):
            assert torch.equal(r[key], torch.full((2, 3), 3.0)), key
        assert torch.equal(r["scaled"], torch.full((2, 3), 3.0))  # (1*2 + 2*2) * 0.5
        assert torch.equal(r["min"], torch.full((2, 3), 1.0)) and torch.equal(r["max"], torch.full((2, 3), 2.0))
        assert torch.equal(r["product"], torch.full((2, 3), 2.0))
        assert torch.equal(r["int_average"], torch.tensor([1, 3, -1]))  # truncated toward zero, as Horovod's
        assert r["input_untouched"] and r["inplace_is_same"] and r["async_inplace"]
        assert r["poll_type"] == "bool" and r["poll_after"] is True
        assert [t[0, 0].item() for t in r["grouped"]] == [3.0, 6.0]
        assert torch.allclose(r["fp16_compressed"], torch.full((2, 3), 0.5), rtol=1e-3)
        assert r["fp16_compressed"].dtype == torch.float32  # decompressed to the input's dtype
        assert torch.equal(r["allreduce_grad"], torch.full((3,), 2.0))


def test_allgather_concatenates_different_first_dimensions(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["allgather"], torch.tensor([[0.0, 0], [0, 0], [1, 1], [1, 1], [1, 1]]))
        assert torch.equal(r["allgather_async"], torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [4, 5]]).int())
    # gradient of sum(w * allgather(g)) with row weights 0..4, averaged over the 2 ranks: this rank's rows
    assert torch.equal(ranks[0]["allgather_grad"], torch.tensor([[0.0, 0], [1, 1]]))
    assert torch.equal(ranks[1]["allgather_grad"], torch.tensor([[2.0, 2], [3, 3], [4, 4]]))


def test_broadcasts_and_objects(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert torch.equal(r["broadcast"], torch.full((2, 3), 2.0)) and torch.equal(r["broadcast_"], r["broadcast"])
        assert torch.equal(r["broadcast_async"], torch.full((2, 3), 1.0)) and r["broadcast_input_untouched"]
        assert r["broadcast_object"] == {"rank": 1, "list": [1, 1]}
        assert r["allgather_object"] == [("from", 0, ""), ("from", 1, "x" * 100)]
    assert torch.equal(ranks[0]["broadcast_grad"], torch.zeros(2))
    assert torch.equal(ranks[1]["broadcast_grad"], torch.full((2,), 3.0))
    for key, value in ranks[0]["state_dict"].items():  # the weights and BatchNorm's buffers, all rank 0's
        assert torch.equal(value, ranks[1]["state_dict"][key]), key
    for a, b in zip(ranks[0]["named_parameters"], ranks[1]["named_parameters"], strict=True):
        assert torch.equal(a, b)


def test_errors_say_what_is_allowed(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        e = r["errors"]
        assert e["trailing"].startswith("HorovodInternalError: hvd.allgather: the ranks called different collectives")
        assert "rank 0: hvd.allgather(dtype=float32, shape=(*, 3), device=cpu)" in e["trailing"]
        assert "rank 1: hvd.allgather(dtype=float32, shape=(*, 4), device=cpu)" in e["trailing"]
        assert "Fix: tensor.reshape(1)" in e["scalar"]
        assert e["both_ops"].endswith("the op parameter supersedes average. Please provide only one of them.")
        assert e["adasum"].startswith("NotImplementedError: hvd.allreduce(op=hvd.Adasum): Adasum is not supported")
        assert "Fix: op=hvd.Average" in e["adasum"]
        assert e["root"] == "ValueError: hvd.broadcast: root_rank=2, but the ranks are 0..1"
        assert "give a hvd.ProcessSet" in e["process_set"] and "contiguous" in e["not_contiguous"]
        assert "MPI communicators are not supported" in e["comm"] and "torch.profiler" in e["timeline"]


def _one_plain_process(rank: int) -> dict[str, Any]:
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key)  # `python train.py`: no launcher's variables at all
    hvd.init()
    model = nn.Linear(3, 1)
    before = model.weight.detach().clone()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    model(torch.ones(2, 3)).sum().backward()
    expected = before - 0.1 * model.weight.grad
    opt.step()
    result = {
        "who": [hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()],
        "allreduce": hvd.allreduce(torch.tensor([3.0])),
        "allgather": hvd.allgather(torch.ones(2, 1)),
        "object": hvd.broadcast_object("same"),
        "objects": hvd.allgather_object(7),
        "join": hvd.join(),
        "stepped": torch.equal(model.weight.detach(), expected),
    }
    hvd.barrier()
    hvd.shutdown()
    result["after_shutdown"] = hvd.is_initialized()
    return result


def test_one_plain_process_is_world_size_one() -> None:
    [r] = run_distributed(_one_plain_process, 1, timeout_s=60)
    assert r["who"] == [0, 1, 0, 1] and torch.equal(r["allreduce"], torch.tensor([3.0]))
    assert torch.equal(r["allgather"], torch.ones(2, 1)) and r["object"] == "same" and r["objects"] == [7]
    assert r["join"] == 0 and r["stepped"] and r["after_shutdown"] is False


def test_sync_batchnorm_is_trainmeshs() -> None:
    from trainmesh.layers import SyncBatchNorm  # tested in tests/distributed/test_sync_batchnorm.py

    assert hvd.SyncBatchNorm is SyncBatchNorm and hvd.SyncBatchNorm(3, eps=1e-3, momentum=0.2).eps == 1e-3


def test_calls_before_init_raise_horovods_error() -> None:
    assert not hvd.is_initialized()
    for call in (hvd.rank, hvd.size, hvd.local_rank, hvd.cross_size, lambda: hvd.allreduce(torch.ones(1))):
        with pytest.raises(ValueError, match=r"^Horovod has not been initialized; use hvd.init\(\).$"):
            call()
