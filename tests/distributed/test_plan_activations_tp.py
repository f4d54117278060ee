"""The GPT's activation model (plan/activations.py) under tensor parallelism, held to the bytes each of 2 gloo ranks
really holds: Runtime(parallel.tp=2) with the GPT's plan (column-parallel qkv and fc, row-parallel projections, the
vocabulary-parallel embedding and head with logits gathered whole, LayerNorms replicated), counted in each rank's
local tensors. Three setups in one pair of processes: fp32 with fused attention; bf16-mixed with math attention and
block 0 of 2 checkpointed; bf16-true with every block checkpointed."""

from __future__ import annotations

import pytest

from support import gpt_saved_bytes
from trainmesh.apps.plan.activations import gpt_activations
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

SHAPE = (2, 4, 64, 96, 24, 2)  # n_layer, n_head, n_embd, vocab, seq, batch
SETUPS = [("32-true", "flash", 0), ("bf16-mixed", "math", 2), ("bf16-true", "flash", 1)]


def measure_rank(rank: int) -> list[tuple[list[int], int, int]]:
    del rank
    return [gpt_saved_bytes(SHAPE, precision, every, attention, tp=2) for precision, attention, every in SETUPS]


def test_tensor_parallel_activations_per_rank() -> None:
    ranks = run_distributed(measure_rank, 2)
    assert ranks[0] == ranks[1]  # a Megatron-style plan without sequence parallelism: the ranks hold alike
    for (precision, attention, every), (blocks, outside, copies) in zip(SETUPS, ranks[0], strict=True):
        acts = gpt_activations(*SHAPE, precision=precision, checkpoint_every=every, tp=2, attention=attention)
        expected = [acts.checkpointed_block if every and i % every == 0 else acts.per_block for i in range(2)]
        assert (blocks, outside, copies) == (expected, acts.outside, acts.weight_copies), precision
