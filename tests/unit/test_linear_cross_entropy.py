"""The head fused with the loss (layers/linear_cross_entropy.py, `model.loss_chunk_tokens`) against the plain head and
`F.cross_entropy`: the summed loss and the gradients of the hidden states and the weight, in fp32 and under bf16
autocast, with ignored targets and chunks of every size; and the settings it refuses."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trainmesh.apps.plan.check import local_cluster, memory_lines
from trainmesh.job.spec import load_config, resolve
from trainmesh.layers import linear_cross_entropy as lce
from trainmesh.layers.linear_cross_entropy import linear_cross_entropy
from trainmesh.recipes.gpt.model import GPT, IGNORE_INDEX, GPTConfig, summed_lm_loss

N, C, V = 37, 16, 50  # tokens (not a multiple of any chunk below), width, vocabulary


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, C, generator=gen, requires_grad=True)
    weight = torch.randn(V, C, generator=gen, requires_grad=True)
    targets = torch.randint(V, (N,), generator=gen)
    targets[::5] = IGNORE_INDEX
    return hidden, weight, targets


def _loss_and_grads(fused: int, bf16: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed loss times 0.5 backpropagated (an upstream gradient other than 1): loss, d hidden, d weight."""
    hidden, weight, targets = _inputs()
    with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
        if fused:
            loss = linear_cross_entropy(hidden, weight, targets, fused, IGNORE_INDEX)
        else:  # the plain head: logits in the compute dtype, the loss in fp32
            loss = F.cross_entropy((hidden @ weight.T).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * 0.5).backward()
    assert hidden.grad is not None and weight.grad is not None
    return loss.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("chunk", [1, 8, N, 100])
def test_the_fused_head_equals_the_plain_head_in_fp32(chunk: int) -> None:
    loss, d_hidden, d_weight = _loss_and_grads(chunk, bf16=False)
    ref_loss, ref_hidden, ref_weight = _loss_and_grads(0, bf16=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(d_hidden, ref_hidden, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_weight, ref_weight, rtol=1e-5, atol=1e-6)
    assert d_hidden[::5].abs().max() == 0  # ignored targets give their tokens no gradient


@pytest.mark.parametrize("chunk", [8, 100])
def test_under_bf16_autocast_the_fused_head_computes_as_the_plain_one(chunk: int) -> None:
    """The same bf16 matmuls and fp32 loss; one chunk is the plain head bit for bit, more sum the weight's gradient
    over chunks in fp32 (closer to exact than one bf16 matmul over every token)."""
    loss, d_hidden, d_weight = _loss_and_grads(chunk, bf16=True)
    ref_loss, ref_hidden, ref_weight = _loss_and_grads(0, bf16=True)
    assert d_hidden.dtype == torch.float32 and d_weight.dtype == torch.float32  # the inputs' dtypes
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(d_hidden, ref_hidden, rtol=0, atol=0)
    tolerance = 0 if chunk >= N else 1e-2  # bf16 keeps 8 bits: the summed chunks round differently
    torch.testing.assert_close(d_weight, ref_weight, rtol=tolerance, atol=tolerance)


def test_a_gpt_given_targets_returns_its_summed_loss_and_logits_otherwise() -> None:
    cfg = GPTConfig(size="nano", block_size=8, vocab_size=32, loss_chunk_tokens=5)
    model = GPT(cfg, seed=0)
    idx = torch.randint(32, (3, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.roll(idx, -1, dims=1)
    logits = model(idx)
    assert logits.shape == (3, 8, 32)
    fused = model(idx, targets)
    assert fused.dim() == 0 and torch.equal(summed_lm_loss(fused, targets), fused)  # the recipe's loss passes it on
    replicas = torch.stack([fused, 2 * fused])  # nn.DataParallel (parallel.strategy=dp) gathers scalars into a vector
    torch.testing.assert_close(summed_lm_loss(replicas, targets), 3 * fused)
    torch.testing.assert_close(fused, summed_lm_loss(logits, targets), rtol=1e-6, atol=0)


def test_chunks_are_refused_where_the_head_is_cut_and_below_one_token() -> None:
    with pytest.raises(ValueError, match=r"model.loss_chunk_tokens=-1 must be >= 0"):
        load_config(None, ["--model.size=nano", "--model.loss_chunk_tokens=-1"], "gpt")
    for cut in ("--parallel.pp=2", "--parallel.tp=2"):
        config = load_config(None, ["--model.size=nano", "--model.loss_chunk_tokens=64", cut], "gpt")
        with pytest.raises(ValueError, match=r"model.loss_chunk_tokens=64 fuses the head of a GPT run whole.*Fix"):
            resolve(config, 2)
    with pytest.raises(ValueError, match="chunk_tokens=0"):
        linear_cross_entropy(*_inputs(), 0)


def test_check_says_its_memory_line_does_not_model_the_fused_head() -> None:
    config = load_config(None, ["--model.size=nano", "--model.vocab_size=256", "--model.loss_chunk_tokens=64"], "gpt")
    lines = memory_lines(resolve(config, 1), local_cluster(1))
    assert "model.loss_chunk_tokens is not modelled: predicted with the head's logits whole" in lines[-1]


def test_without_gradients_only_the_loss_is_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Evaluation runs under torch.no_grad: the forward must not compute gradients nobody asks for (3 matmuls a
    chunk instead of 1)."""
    hidden, weight, targets = _inputs()
    with_grads = linear_cross_entropy(hidden, weight, targets, 8, IGNORE_INDEX).detach()
    monkeypatch.setattr(lce._LinearCrossEntropy, "apply", lambda *args: pytest.fail("gradients computed"))
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets, 8, IGNORE_INDEX)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, with_grads, rtol=0, atol=0)


def test_an_ignored_tokens_non_finite_state_stays_out_and_double_backward_is_refused() -> None:
    """As F.cross_entropy: an ignored token's hidden state takes no part, even NaN (a padded position). The gradients
    are numbers computed in the forward: a second derivative cannot come from them, so asking for one raises."""
    hidden, weight, targets = _inputs()
    poisoned = hidden.detach().clone()
    poisoned[0] = float("nan")  # targets[0] is ignored
    assert targets[0] == IGNORE_INDEX
    poisoned.requires_grad_(True)
    loss = linear_cross_entropy(poisoned, weight, targets, 8, IGNORE_INDEX)
    ref = F.cross_entropy((poisoned @ weight.T).float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    (grad,) = torch.autograd.grad(loss, poisoned, create_graph=True)
    assert torch.isfinite(grad[1:]).all() and grad[0].abs().max() == 0
    with pytest.raises(RuntimeError, match="once_differentiable|does not require grad"):
        grad.sum().backward()
