from __future__ import annotations

import pytest
import torch

from trainmesh.core.batch import BatchMathError, BatchSplit, loss_scale


def test_accumulation_is_derived() -> None:
    plan = BatchSplit.derive(micro_batch=4, global_batch=32, dp_size=2)
    assert plan.accum_steps == 4
    assert "32 samples = micro-batch 4 × 4 accumulation step(s) × 2 data-parallel rank(s)" in plan.describe()


def test_default_global_batch_is_one_micro_step() -> None:
    assert BatchSplit.derive(micro_batch=4, dp_size=3).global_batch == 12


def test_gpt2_half_million_tokens() -> None:
    plan = BatchSplit.derive(micro_batch=16, global_batch_tokens=524288, dp_size=8, tokens_per_sample=1024)
    assert (plan.global_batch, plan.accum_steps, plan.tokens_per_step) == (512, 4, 524288)


def test_indivisible_global_batch_shows_the_arithmetic() -> None:
    with pytest.raises(BatchMathError) as err:
        BatchSplit.derive(micro_batch=16, global_batch_tokens=524288, dp_size=3, tokens_per_sample=1024)
    message = str(err.value)
    assert "train.global_batch_tokens=524288 (= 512 sequences × 1024 tokens)" in message
    assert "train.micro_batch=16 × 3 data-parallel rank(s) = 48" in message
    assert "512 / 48 = 10.67" in message
    assert "multiple of 49152 tokens (e.g. --train.global_batch_tokens=491520 or 540672)" in message


def test_indivisible_sample_batch_suggests_samples() -> None:
    with pytest.raises(
        BatchMathError, match=r"10 / 4 = 2.50.*multiple of 4 samples \(e.g. --train.global_batch=8 or 12\)"
    ):
        BatchSplit.derive(micro_batch=2, global_batch=10, dp_size=2)


def test_tokens_that_are_not_whole_sequences() -> None:
    with pytest.raises(BatchMathError, match=r"1000 / 128 = 7.81.*--train.global_batch_tokens=896 or 1024"):
        BatchSplit.derive(micro_batch=8, global_batch_tokens=1000, dp_size=1, tokens_per_sample=128)


def test_tokens_for_a_non_token_recipe() -> None:
    with pytest.raises(BatchMathError, match="use train.global_batch"):
        BatchSplit.derive(micro_batch=8, global_batch_tokens=1000, dp_size=1, tokens_per_sample=0)


def test_loss_scale_gives_the_global_mean_gradient() -> None:
    """Summed losses × dp/count, averaged over ranks, equal the mean over every target of the batch."""
    torch.manual_seed(0)
    w = torch.randn(3, requires_grad=True)
    xs = [torch.randn(n, 3) for n in (5, 1, 7, 3)]  # 4 micro-batches with different target counts
    ref = torch.autograd.grad(torch.cat(xs).matmul(w).square().mean(), w)[0]
    count = sum(len(x) for x in xs)
    dp = 2  # ranks 0 and 1 hold micro-batches (0, 1) and (2, 3); DDP averages their gradients
    per_rank = [
        sum(
            torch.autograd.grad(x.matmul(w).square().sum() * loss_scale(count, dp), w)[0] for x in xs[r * 2 : r * 2 + 2]
        )
        for r in range(dp)
    ]
    torch.testing.assert_close(sum(per_rank) / dp, ref)
    with pytest.raises(ValueError, match="no targets"):
        loss_scale(0, 1)


def test_an_elastic_range_gets_a_fix_that_divides_at_every_size() -> None:
    """--nnodes 1:3 with 8 GPUs per node: data-parallel sizes 8, 16, 24. The fix suggested for one size used
    to fail at the next; the suggestion must split at all of them."""
    sizes = (8, 16, 24)
    with pytest.raises(BatchMathError) as info:
        for dp in sizes:
            BatchSplit.derive(
                micro_batch=16, global_batch_tokens=524288, dp_size=dp, tokens_per_sample=1024, other_dp_sizes=sizes
            )
    message = str(info.value)
    assert "multiple of 786432 tokens at every data-parallel size this job may run at (8, 16, 24)" in message
    for suggested in (786432, 1572864):
        assert f"{suggested}" in message
        assert all(
            BatchSplit.derive(
                micro_batch=16, global_batch_tokens=suggested, dp_size=dp, tokens_per_sample=1024, other_dp_sizes=sizes
            ).accum_steps
            >= 1
            for dp in sizes
        )
