from __future__ import annotations

import pytest
import torch

from trainmesh.core.batch import BatchSplit
from trainmesh.data.sharding import (
    DataPosition,
    DatasetTooSmallError,
    GlobalBatchSampler,
    eval_micro_batches,
    position_at_step,
)


def _plan(micro: int, dp: int, global_batch: int) -> BatchSplit:
    return BatchSplit(global_batch, micro, dp, global_batch // (micro * dp))


def _rank_ids(num: int, plan: BatchSplit, rank: int, step: int, seed: int = 0) -> list[int]:
    sampler = GlobalBatchSampler(num, plan, rank, seed)
    return [i for mb in sampler.micro_batches(step) for i in mb]


def test_ranks_are_disjoint_and_cover_the_epoch() -> None:
    plan = _plan(micro=3, dp=2, global_batch=12)
    num = 100  # 8 full steps per epoch; the ragged 4 samples are dropped
    seen: list[int] = []
    for step in range(8):
        per_rank = [_rank_ids(num, plan, r, step) for r in range(2)]
        assert not set(per_rank[0]) & set(per_rank[1])
        seen += per_rank[0] + per_rank[1]
    assert len(seen) == len(set(seen)) == 96
    assert set(seen) <= set(range(num))


def test_order_is_reproducible_from_the_seed_and_reshuffled_each_epoch() -> None:
    plan = _plan(micro=4, dp=1, global_batch=8)
    a = GlobalBatchSampler(64, plan, 0, seed=7)
    b = GlobalBatchSampler(64, plan, 0, seed=7)
    c = GlobalBatchSampler(64, plan, 0, seed=8)
    assert torch.equal(a.epoch_order(0), b.epoch_order(0))
    assert not torch.equal(a.epoch_order(0), c.epoch_order(0))
    assert not torch.equal(a.epoch_order(0), a.epoch_order(1))
    assert (
        a.position_after(8) == DataPosition(0, 64) and a.global_batch_ids(8).tolist() == a.epoch_order(1)[:8].tolist()
    )


def test_each_step_trains_on_the_same_samples_at_any_world_size() -> None:
    for step in (0, 5, 13):
        one = _rank_ids(200, _plan(micro=8, dp=1, global_batch=16), 0, step)
        two = [i for r in range(2) for i in _rank_ids(200, _plan(micro=4, dp=2, global_batch=16), r, step)]
        four = [i for r in range(4) for i in _rank_ids(200, _plan(micro=2, dp=4, global_batch=16), r, step)]
        assert sorted(one) == sorted(two) == sorted(four)


def test_iterator_resumes_at_a_step() -> None:
    plan = _plan(micro=2, dp=2, global_batch=8)
    full = GlobalBatchSampler(40, plan, 1, seed=3)
    it = iter(full)
    batches = [next(it) for _ in range(plan.accum_steps * 7)]
    start = full.position_after(4)
    assert start == position_at_step(4, 8, 40) == DataPosition(0, 32)
    resumed = iter(GlobalBatchSampler(40, plan, 1, seed=3, start=start))
    assert [next(resumed) for _ in range(plan.accum_steps * 3)] == batches[plan.accum_steps * 4 :]


@pytest.mark.parametrize(("before", "after"), [(8, 4), (8, 12), (4, 16), (12, 8)])
def test_a_changed_global_batch_continues_at_the_samples_seen(before: int, after: int) -> None:
    """Resuming with another global batch (world size or micro-batch changed, global_batch unset) neither
    repeats nor skips a sample: each epoch takes a prefix of its order, every sample at most once, and
    stops short only by a ragged end smaller than a global batch."""
    num = 40
    first = GlobalBatchSampler(num, _plan(micro=before, dp=1, global_batch=before), 0, seed=5)
    second = GlobalBatchSampler(
        num, _plan(micro=after, dp=1, global_batch=after), 0, seed=5, start=first.position_after(7)
    )
    by_epoch: dict[int, list[int]] = {}
    for sampler, steps in ((first, 7), (second, 9)):
        for step in range(steps):
            ids = sampler.global_batch_ids(step).tolist()
            at = sampler.position_after(step)
            epoch = at.epoch + (at.offset + sampler.split.global_batch > num)  # a ragged end starts the next
            by_epoch.setdefault(epoch, []).extend(ids)
    assert len(by_epoch) >= 3
    for epoch, ids in sorted(by_epoch.items()):
        assert ids == first.epoch_order(epoch).tolist()[: len(ids)], f"epoch {epoch}: repeated or skipped samples"
        if epoch < max(by_epoch):
            assert num - len(ids) < max(before, after), f"epoch {epoch} ended early"


def test_dataset_smaller_than_a_global_batch_is_rejected() -> None:
    with pytest.raises(DatasetTooSmallError, match="3 samples, fewer than one global batch of 4"):
        GlobalBatchSampler(3, _plan(micro=2, dp=2, global_batch=4), 0, seed=0)


def test_eval_slice_is_the_same_at_every_world_size() -> None:
    for dp in (1, 2, 3):
        shares = [eval_micro_batches(50, 22, 4, r, dp) for r in range(dp)]
        ids = [i for share in shares for batch in share for i in batch]
        assert sorted(ids) == list(range(22)) and len(ids) == len(set(ids))
        assert len({len(share) for share in shares}) == 1  # the same number of forwards on every rank
    assert eval_micro_batches(50, 22, 4, 3, 4) == [[12, 13, 14, 15], []]  # 6 micro-batches over 4 ranks: padded
    assert [len(b) for b in eval_micro_batches(50, 22, 4, 0, 1)] == [4, 4, 4, 4, 4, 2]
    assert sum(len(b) for b in eval_micro_batches(5, 22, 4, 0, 1)) == 5  # fewer exist: all of them
    with pytest.raises(DatasetTooSmallError, match="validation set is empty"):
        eval_micro_batches(0, 22, 4, 0, 2)


def test_the_ragged_end_of_an_epoch_never_gives_ranks_unequal_work() -> None:
    """42 samples, 8 per step: the last 2 of each epoch are dropped, so at every step, across epoch
    boundaries, each rank gets the same number of equally sized micro-batches (no rank waits alone)."""
    plan = _plan(micro=4, dp=2, global_batch=8)
    samplers = [GlobalBatchSampler(42, plan, rank, seed=3) for rank in (0, 1)]
    assert samplers[0].steps_per_epoch == 5
    for step in range(12):  # into the third epoch
        shapes = [[len(mb) for mb in sampler.micro_batches(step)] for sampler in samplers]
        assert shapes == [[4], [4]], step
    epoch_ids = [i for step in range(5) for sampler in samplers for mb in sampler.micro_batches(step) for i in mb]
    assert len(set(epoch_ids)) == 40  # each used sample once per epoch
