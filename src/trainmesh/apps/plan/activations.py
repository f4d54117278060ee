"""Activation memory of trainmesh's GPT (recipes/gpt/model.py) per rank, in bytes: what autograd holds from the
forward of one micro-batch to its backward, by precision, activation checkpointing, tensor parallelism and
attention kernel. tests/unit/test_plan_activations.py and tests/distributed/test_plan_activations_tp.py measure it
on the real model (each storage once, the way benchmarks/memory.py counts) and hold it to the byte.

Per token (T = s·b of them), with p and c the precision's parameter and compute element sizes (memory.py), h the
width, a the heads, V the vocabulary and t the tensor-parallel degree; q, k, v and SDPA run on this rank's a/t heads:

- a block, SDPA (flash or efficient kernel): 2p·h (the two LayerNorms' inputs, the residual stream) + 4p (their mean
  and rstd) + c·h (the q/k/v projection's input) + 3c·h/t (its output, which SDPA saves as q, k, v) + c·h/t (SDPA's
  output, also the output projection's input) + 4a/t (SDPA's fp32 logsumexp) + c·h (the MLP's input) + 8c·h/t (the
  GELU's input and output). Unsharded: 64h + 16 + 4a (32-true), 36h + 16 + 4a (the mixed ones), 32h + 8 + 4a
  (bf16-true).
- a block, math attention (`attention="math"`, no fused kernel): the q/k/v output is not kept; the math path keeps
  fp32 copies of q·√scale, k·√scale and v (12h/t: it computes in fp32 even from bf16/fp16, unless
  torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp is set), the fp32 softmax (4a·s/t, the s×s matrix) and
  its output in the compute dtype (c·h/t), and no logsumexp.
- under a mixed precision (p ≠ c), autocast's c-byte copies of the block's four matmul weights, 12h²/t elements,
  which autograd keeps too (the weights themselves belong to the model states and are not counted).
- a checkpointed block (torch.utils.checkpoint, non-reentrant) keeps only its input, p·h per token (fp32 under the
  mixed precisions: the residual stream). Its backward first recomputes its forward and holds what that saves,
  one block at a time: the transient `recompute_peak`. Under a mixed precision autocast's cache also holds the
  checkpointed blocks' weight copies until the autocast region ends, after the loss: in the forward's own peak, not
  in `total`, which is what backward starts from.
- outside the blocks: the loss's fp32 log-softmax (4V: logits are gathered whole under TP, and summed_lm_loss
  takes the cross-entropy of fp32 logits), ln_f's input (p·h) and statistics (2p), lm_head's input (c·h), int64 token
  ids, targets (T each) and positions (s), the loss's fp32 total weight (4 bytes), and under a mixed precision the
  copy of the tied lm_head weight (V·h/t elements of c bytes).

Measured on the CPU (torch 2.13), not on CUDA, whose kernels save a little otherwise (from their source): fp32 SDPA
runs the memory-efficient kernel, whose logsumexp may be padded to a multiple of 32 positions (at most 124·b·a/t
bytes more per block); LayerNorm keeps bf16-true's statistics in fp32 (8 bytes more per token per block, 4
outside); the fused kernels keep an RNG seed and offset (a few bytes per block). Dropout is taken as 0 (trainmesh's
default); above 0 its masks add to this. Under fsdp with a mixed precision this model does not apply: FSDP gathers
every parameter in the compute dtype (LayerNorms and embeddings too), so the residual stream runs in bf16/fp16 and
autocast copies nothing; on the CPU the activations then equal bf16-true's.
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
