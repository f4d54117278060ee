from __future__ import annotations

import math

import pytest
import torch

from trainmesh.config.schema import DistConfig
from trainmesh.recipes.gpt.model import GPT, SIZES, GPTConfig, init_gpt_weights, summed_lm_loss
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import ParallelPlan


def _nano(**kw: object) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(size="nano", block_size=16, vocab_size=64, **kw))  # type: ignore[arg-type]


def test_shapes_and_weight_tying() -> None:
    model = _nano()
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    assert model.lm_head.weight is model.wte.weight


def test_untrained_loss_is_near_uniform() -> None:
    model = _nano()
    x, y = torch.randint(0, 64, (2, 8, 16))  # targets independent of inputs (tied weights favour x itself)
    with torch.no_grad():
        mean = summed_lm_loss(model(x), y) / y.numel()
    assert abs(float(mean) - math.log(64)) < 0.1


def test_gpt2_sizes_have_published_parameter_counts() -> None:
    cfg = GPTConfig(size="gpt2", block_size=1024, vocab_size=50257)
    with torch.device("meta"):  # shapes only, no memory
        model = GPT(cfg)
    assert round(model.num_params(non_embedding=False) / 1e6) == 124
    assert SIZES["gpt2-medium"] == (24, 16, 1024) and SIZES["gpt2-large"] == (36, 20, 1280)


def test_flops_per_token_match_the_published_gpt2_figures() -> None:
    """GPT-2 124M (vocabulary 50304, 1024 tokens): nanoGPT's estimate_mfu gives 855.4 MFLOPs per token and
    Megatron-LM's formula 854.7 M; 6N alone (746.9 M) leaves out attention's 12·L·h·s."""
    with torch.device("meta"):
        model = GPT(GPTConfig(size="gpt2", block_size=1024, vocab_size=50304))
    assert model.flops_per_token() == pytest.approx(855.4e6, rel=1e-3)
    assert model.flops_per_token() == pytest.approx(854.7e6, rel=2e-3)
    with torch.device("meta"):  # attention's share grows with the sequence: twice as many tokens of context
        longer = GPT(GPTConfig(size="gpt2", block_size=2048, vocab_size=50304))
    assert longer.flops_per_token() - model.flops_per_token() == pytest.approx(12 * 12 * 768 * 1024, rel=0.01)


def test_residual_projections_use_scaled_init() -> None:
    model = GPT(GPTConfig(size="small", block_size=16, vocab_size=64))
    std = model.blocks[0].mlp.proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(2 * 6)) < 0.001


def test_ignored_targets_do_not_count() -> None:
    logits = torch.randn(1, 4, 10)
    targets = torch.tensor([[1, 2, -100, -100]])
    full = summed_lm_loss(logits[:, :2], targets[:, :2])
    torch.testing.assert_close(summed_lm_loss(logits, targets), full)


def test_generate_extends_the_prompt() -> None:
    model = _nano().eval()
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), max_new_tokens=20, temperature=1.0, top_k=5)
    assert out.shape == (1, 23) and int(out.max()) < 64


def test_sequence_longer_than_block_size() -> None:
    with pytest.raises(ValueError, match="exceeds model.block_size=16"):
        _nano()(torch.zeros(1, 17, dtype=torch.long))


def test_a_gpt_built_on_the_meta_device_is_initialised_like_a_whole_one() -> None:
    """init_gpt_weights draws each parameter from its own stream: the same weights whether the model
    is built whole or on the meta device and materialised by the strategy (parallel.meta_init)."""
    cfg = GPTConfig(size="nano", vocab_size=64, block_size=16)
    whole = GPT(cfg, seed=7)
    with torch.device("meta"):
        late = GPT(cfg, seed=7)
    assert all(p.is_meta for p in late.parameters())
    plan = ParallelPlan(init_weights=lambda part: init_gpt_weights(part, seed=7))
    late = Runtime(strategy="single", dist_config=DistConfig(device="cpu")).setup(late, plan=plan)
    assert late.lm_head.weight is late.wte.weight  # still one tensor
    for (name, p), q in zip(whole.named_parameters(), late.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(whole.wte.weight, GPT(cfg, seed=8).wte.weight)
    with torch.device("meta"):
        uninitialisable = GPT(cfg)
    with pytest.raises(ValueError, match=r"meta device.*--parallel.meta_init=false"):
        Runtime(strategy="single", dist_config=DistConfig(device="cpu")).setup(uninitialisable)
