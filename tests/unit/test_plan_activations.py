"""The GPT's activation model (plan/activations.py) held to the bytes autograd really saves on the real model, set up
the way trainmesh trains it (Runtime: the precision's module conversion and autocast, the blocks' checkpointing),
for every precision, both attention kernels and activation checkpointing; tensor parallelism is measured in
tests/distributed/test_plan_activations_tp.py."""

from __future__ import annotations

import pytest

from support import gpt_saved_bytes
from trainmesh.apps.plan.activations import ATTENTION, GPTActivations, gpt_activations
from trainmesh.config.schema import PRECISIONS

pytestmark = pytest.mark.timeout(60)

PLANNED = [p for p in PRECISIONS if p != "fp8-mixed"]  # trainmesh plan does not model fp8-mixed (it refuses it)
SHAPE = (3, 4, 64, 96, 24, 2)
"""n_layer, n_head, n_embd, vocab, seq, batch: every width differs (head size 16, seq 24, vocab 96, h 64), so a term
counted with the wrong one cannot pass."""


def korthikanti_per_layer(
    seq: int,
    batch: int,
    n_embd: int,
    n_head: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models" (arXiv 2205.05198), Table 2:
    activation bytes per transformer layer, 16-bit activations with 1-byte dropout masks and the attention matrix
    kept: sbh(34 + 5as/h) alone, sbh(10 + 24/t + 5as/(ht)) with tensor parallelism, sbh(34/t + 5as/(ht)) with
    sequence parallelism too; selective recomputation (`recompute="selective"`) drops the 5as/(ht) term, full
    recomputation (`recompute="full"`) keeps 2sbh (each layer's input). A published reference to compare with, not
    what trainmesh saves (gpt_activations): trainmesh keeps LayerNorm inputs in fp32 under the mixed precisions,
    has no dropout by default and runs fused attention."""
    s, b, h, a, t = seq, batch, n_embd, n_head, tp
    if recompute == "full":
        return 2 * s * b * h
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute={recompute!r} is not one of none, selective, full")
    attention_matrix = 0.0 if recompute == "selective" else 5 * a * s / (h * t)  # softmax, its dropout mask, output
    linear = 34 / t if sequence_parallel else 10 + 24 / t
    return s * b * h * (linear + attention_matrix)


def predicted_blocks(acts: GPTActivations, every: int) -> list[int]:
    return [acts.checkpointed_block if every and i % every == 0 else acts.per_block for i in range(acts.n_layer)]


@pytest.mark.parametrize(
    ("n_layer", "n_head", "n_embd", "vocab", "seq", "batch"),
    [(2, 2, 64, 256, 32, 2), (3, 4, 64, 512, 16, 3), (2, 4, 128, 100, 24, 1)],
)
def test_the_fp32_flash_formula_matches_what_autograd_saves(
    n_layer: int, n_head: int, n_embd: int, vocab: int, seq: int, batch: int
) -> None:
    """Per block 4·T·(16h + 4 + a); outside 4·T·(V + 2h + 2) + 8·(2T + s) + 4 (T = s·b tokens)."""
    shape = (n_layer, n_head, n_embd, vocab, seq, batch)
    blocks, outside, copies = gpt_saved_bytes(shape)
    acts = gpt_activations(*shape)
    assert (blocks, outside, copies) == ([acts.per_block] * n_layer, acts.outside, 0)
    tokens = seq * batch
    assert acts.per_block == 4 * tokens * (16 * n_embd + 4 + n_head)
    assert acts.total == sum(blocks) + outside


@pytest.mark.parametrize("attention", ATTENTION)
@pytest.mark.parametrize("precision", PLANNED)
def test_every_precision_and_attention_kernel_with_checkpointing(precision: str, attention: str) -> None:
    """Blocks 0 and 2 of 3 checkpointed (parallel.activation_checkpointing=2): each keeps its input; block 1 all of
    its activations. 16-mixed is measured too: CPU autocast runs float16 in torch 2.13 (same sizes as bf16-mixed)."""
    every = 2
    blocks, outside, copies = gpt_saved_bytes(SHAPE, precision, every, attention)
    acts = gpt_activations(*SHAPE, precision=precision, checkpoint_every=every, attention=attention)
    assert (blocks, outside, copies) == (predicted_blocks(acts, every), acts.outside, acts.weight_copies)
    assert acts.blocks_checkpointed == 2 and acts.total == sum(blocks) + outside
    # What a checkpointed block brings back in its backward: a plain block's activations but the input it kept.
    assert acts.recompute_peak == blocks[1] - blocks[0]
    assert (copies > 0) == precision.endswith("mixed")


@pytest.mark.parametrize("every", [1, 5])
def test_every_block_or_only_the_first_checkpointed(every: int) -> None:
    blocks, outside, _ = gpt_saved_bytes(SHAPE, "bf16-mixed", every)
    acts = gpt_activations(*SHAPE, precision="bf16-mixed", checkpoint_every=every)
    assert (blocks, outside) == (predicted_blocks(acts, every), acts.outside)
    assert acts.blocks_checkpointed == (3 if every == 1 else 1)


def test_the_exact_formulas_written_out() -> None:
    """The docstring's formulas in numbers (T tokens), against the paper's 16-bit count."""
    _, a, h, vocab, s, b = SHAPE
    tokens = s * b
    mixed = gpt_activations(*SHAPE, precision="bf16-mixed", tp=2, attention="math")
    # fp32 LayerNorm inputs (2·4h), replicated matmul inputs (2·2h), this rank's fp32 q, k, v (12h/t), its output
    # (2h/t) and GELU input and output (16h/t), fp32 statistics, the fp32 s×s softmax of a/t heads
    assert (
        mixed.per_block
        == tokens * (8 * h + 4 * h + 9 * 2 * h // 2 + 12 * h // 2 + 16 + 4 * a * s // 2) + 2 * 12 * h * h // 2
    )
    assert mixed.outside == tokens * (4 * vocab + 4 * h + 2 * h + 8) + 8 * (2 * tokens + s) + 4 + 2 * vocab * h // 2
    # trainmesh's bf16-mixed block with fused attention, less its weight copies, against Korthikanti et al.'s sbh·34
    # (selective recomputation: no attention matrix): +4h for fp32 LayerNorm inputs, -2h for the dropout masks it
    # does not have, and the statistics and logsumexp the paper leaves out.
    fused = gpt_activations(*SHAPE, precision="bf16-mixed")
    paper = korthikanti_per_layer(s, b, h, a, recompute="selective")
    assert fused.per_block - 2 * 12 * h * h == paper + tokens * (2 * h + 16 + 4 * a)
    # full recomputation: the paper's 2sbh is bf16-true's kept input; the mixed precisions keep an fp32 one
    assert gpt_activations(*SHAPE, precision="bf16-true", checkpoint_every=1).checkpointed_block == 2 * s * b * h
    assert korthikanti_per_layer(s, b, h, a, recompute="full") == 2 * s * b * h


def test_korthikanti_table_2() -> None:
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B's layer
    assert korthikanti_per_layer(s, b, h, a) == s * b * h * (34 + 5 * a * s / h)
    assert korthikanti_per_layer(s, b, h, a, tp=1) == korthikanti_per_layer(s, b, h, a, tp=1, sequence_parallel=True)
    assert korthikanti_per_layer(s, b, h, a, tp=8) == s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8))
    assert korthikanti_per_layer(s, b, h, a, tp=8, sequence_parallel=True, recompute="selective") == s * b * h * 34 / 8


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="train.precision='fp8'"):
        gpt_activations(*SHAPE, precision="fp8")
    with pytest.raises(ValueError, match="attention='eager'"):
        gpt_activations(*SHAPE, attention="eager")
    with pytest.raises(ValueError, match="parallel.tp=3"):
        gpt_activations(*SHAPE, tp=3)
    with pytest.raises(ValueError, match="activation_checkpointing=-1"):
        gpt_activations(*SHAPE, checkpoint_every=-1)
    with pytest.raises(ValueError, match="recompute='some'"):
        korthikanti_per_layer(1, 1, 8, 2, recompute="some")
