"""Activation memory of trainmesh's GPT per rank, in bytes: what autograd holds from a micro-batch's forward to its
backward, by precision, activation checkpointing, tensor parallelism and attention kernel, held to the byte by tests
on the real model.

Details: docs/internals.md#appsplanactivationspy
"""

from __future__ import annotations

from dataclasses import dataclass

from trainmesh.apps.plan.memory import element_bytes

ATTENTION = ("flash", "math")
"""flash: scaled_dot_product_attention's fused kernels (flash, memory-efficient, CPU flash), as trainmesh runs;
math: the unfused path (torch.nn.attention.sdpa_kernel(SDPBackend.MATH)), which keeps the s×s attention matrix."""
FP32, INT64 = 4, 8


@dataclass(frozen=True)
class GPTActivations:
    """Bytes one rank holds from forward to backward for one micro-batch of trainmesh's GPT."""

    n_layer: int
    blocks_checkpointed: int
    per_block: int
    """A block that is not checkpointed: all it saves, autocast's weight copies included."""
    checkpointed_block: int
    """A checkpointed block: its input (held by the checkpoint, outside autograd's saved tensors)."""
    outside: int
    """Embeddings, final LayerNorm, head and loss."""
    block_weight_copy: int
    """Of `per_block`: autocast's low-precision copies of the block's matmul weights (mixed precisions; else 0)."""
    head_weight_copy: int
    """Of `outside`: autocast's copy of the tied head weight (mixed precisions; else 0)."""
    recompute_peak: int
    """Held on top of `total` while a checkpointed block's backward runs: its recomputed activations (its
    `per_block` less the input it already holds); 0 without checkpointing."""

    @property
    def weight_copies(self) -> int:
        """Of `total`: autocast's weight copies. Cached by autocast, they exist once per autocast region, however
        many micro-batch pieces a pipeline stage holds."""
        return (self.n_layer - self.blocks_checkpointed) * self.block_weight_copy + self.head_weight_copy

    @property
    def total(self) -> int:
        """At the end of forward, what backward starts from."""
        plain = self.n_layer - self.blocks_checkpointed
        return plain * self.per_block + self.blocks_checkpointed * self.checkpointed_block + self.outside


def gpt_activations(
    n_layer: int,
    n_head: int,
    n_embd: int,
    vocab: int,
    seq: int,
    batch: int,
    *,
    precision: str = "32-true",
    checkpoint_every: int = 0,
    tp: int = 1,
    attention: str = "flash",
) -> GPTActivations:
    """Activation bytes per rank of trainmesh's GPT on `batch` sequences of `seq` tokens, trained at `precision`
    (train.precision), with every `checkpoint_every`-th block checkpointed (parallel.activation_checkpointing: block
    i when i % k == 0; 0: none), over `tp` tensor-parallel ranks (parallel.tp) with `attention` (ATTENTION)."""
    size = element_bytes(precision)
    p, c = size.param, size.compute
    if attention not in ATTENTION:
        raise ValueError(f"attention={attention!r} is not one of {', '.join(ATTENTION)}")
    if checkpoint_every < 0:
        raise ValueError(f"parallel.activation_checkpointing={checkpoint_every} must be >= 0 (0: none)")
    if tp < 1 or n_head % tp or vocab % tp:
        raise ValueError(f"parallel.tp={tp} must be >= 1 and divide model.n_head={n_head} and vocab={vocab}")
    if n_embd % n_head:
        raise ValueError(f"model.n_embd={n_embd} must be divisible by model.n_head={n_head}")
    h, a, tokens = n_embd, n_head, seq * batch
    # Per token in every layout: LayerNorm inputs and statistics, and the inputs of the two column-parallel matmuls,
    # which see the whole (replicated) hidden state.
    replicated = 2 * p * h + 4 * p + 2 * c * h
    mlp = 8 * c * h // tp  # the GELU's 4h-wide input and output, this rank's 4h/t columns
    if attention == "flash":
        attn = 4 * c * h // tp + FP32 * a // tp  # q/k/v (views of one 3h output) and SDPA's output; logsumexp
    else:
        attn = 3 * FP32 * h // tp + FP32 * a * seq // tp + c * h // tp  # fp32 q, k, v; softmax; output
    copies = c if p != c else 0  # autocast copies a weight only when the weight is not already in its dtype
    block_copies = copies * 12 * h * h // tp  # qkv 3h², proj h², fc 4h², proj 4h²
    head_copy = copies * vocab * h // tp
    per_block = tokens * (replicated + attn + mlp) + block_copies
    outside = tokens * (FP32 * vocab + p * h + 2 * p + c * h) + INT64 * (2 * tokens + seq) + FP32 + head_copy
    checkpointed = len(range(0, n_layer, checkpoint_every)) if checkpoint_every else 0  # blocks 0, k, 2k, ...
    input_bytes = tokens * p * h
    return GPTActivations(
        n_layer=n_layer,
        blocks_checkpointed=checkpointed,
        per_block=per_block,
        checkpointed_block=input_bytes,
        outside=outside,
        block_weight_copy=block_copies,
        head_weight_copy=head_copy,
        recompute_peak=per_block - input_bytes if checkpointed else 0,
    )
