"""The memory model of `trainmesh plan`: the ZeRO paper's model-state table, and the GPT's activations held to
the bytes autograd really saves (counted by storage, as benchmarks/memory.py does)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainmesh.plan.memory import StateBytes, gpt_activations, model_states
from trainmesh.recipes.gpt.model import GPT, GPTConfig, summed_lm_loss

pytestmark = pytest.mark.timeout(60)


def test_the_zero_papers_model_state_table_is_reproduced() -> None:
    """ZeRO (arXiv 1910.02054), figure 1 / section 5: 7.5B parameters, 64 GPUs, fp16 + Adam (K = 12)."""
    gb = [model_states(7_500_000_000, 64, stage, StateBytes.zero_paper()).total / 1e9 for stage in (0, 1, 2, 3)]
    assert [round(x, 1) for x in gb] == [120.0, 31.4, 16.6, 1.9]


def test_trainmesh_precisions_and_bad_input() -> None:
    fp32 = model_states(1000, 4, 0, StateBytes.adamw("bf16-mixed"))
    assert (fp32.weights, fp32.grads, fp32.optimizer) == (4000, 4000, 8000)  # 16 bytes per parameter, as DDP
    assert model_states(1000, 4, 3, StateBytes.adamw("32-true")).total == 4000  # FSDP full shard: 16Ψ/N
    assert model_states(1000, 2, 0, StateBytes.adamw("bf16-true")).total == 8000
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        StateBytes.adamw("fp8")
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        model_states(1000, 2, 4, StateBytes.zero_paper())


def saved_bytes(cfg: GPTConfig, batch: int) -> tuple[int, int]:
    """(bytes saved inside the blocks, outside them) by one forward of the real model, each storage once."""
    torch.manual_seed(0)
    model = GPT(cfg)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, tuple[str, torch.Tensor]] = {}
    where = ["outside"]
    for block in model.blocks:
        block.register_forward_pre_hook(lambda *_: where.__setitem__(0, "blocks"))
        block.register_forward_hook(lambda *_: where.__setitem__(0, "outside"))

    def pack(t: torch.Tensor) -> Any:
        key = t.untyped_storage().data_ptr()
        if key not in params and key not in seen:
            seen[key] = (where[0], t)
        return t

    x, y = (torch.randint(cfg.vocab_size, (batch, cfg.block_size)) for _ in range(2))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        summed_lm_loss(model(x), y)
    totals = {"blocks": 0, "outside": 0}
    for kind, t in seen.values():
        totals[kind] += t.untyped_storage().nbytes()
    return totals["blocks"], totals["outside"]


@pytest.mark.parametrize(
    ("n_layer", "n_head", "n_embd", "vocab", "seq", "batch"),
    [(2, 2, 64, 256, 32, 2), (3, 4, 64, 512, 16, 3), (2, 4, 128, 100, 24, 1)],
)
def test_the_gpt_activation_formula_matches_what_autograd_saves(
    n_layer: int, n_head: int, n_embd: int, vocab: int, seq: int, batch: int
) -> None:
    cfg = GPTConfig(size="nano", n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=seq, vocab_size=vocab)
    blocks, outside = saved_bytes(cfg, batch)
    predicted = gpt_activations(n_layer, n_head, n_embd, vocab, seq, batch)
    assert (n_layer * predicted.per_block, predicted.outside) == (blocks, outside)
