"""Memory per rank, predicted: model states (by ZeRO stage) and a GPT's activations, in bytes.

The first piece of `trainmesh plan` (issue: know before you launch). Two models, each stated with its source:

- Model states (Rajbhandari et al., ZeRO, arXiv 1910.02054, section 5): weights, gradients and optimizer state
  per parameter, each either replicated or partitioned over the N data-parallel ranks. Stage 0 (DDP) keeps all
  three whole, stage 1 partitions the optimizer state, stage 2 also the gradients, stage 3 (FSDP full shard) also
  the weights. With the paper's fp16 weights and gradients and fp32 Adam (12 bytes: master weights and two
  moments), 7.5B parameters on 64 GPUs give its 120 / 31.4 / 16.6 / 1.9 GB.
- Activations of trainmesh's GPT (recipes/gpt/model.py), counted from what autograd saves, by storage, for
  fp32 training with SDPA (no attention matrix is kept) and no dropout: per block 16 tensors of s·b·h values
  (ln_1 and ln_2 inputs, the q/k/v projection's input and its 3h-wide output, SDPA's output, the output
  projection's input, the MLP's input, the GELU's 4h-wide input and the second MLP matrix's 4h-wide input), the
  two LayerNorms' mean and rstd (4 values per token) and SDPA's logsumexp (one per head and token); outside the
  blocks the loss's log-softmax (s·b·V), the final LayerNorm's and the head's inputs (2·s·b·h), the final
  LayerNorm's statistics, the token ids, targets and positions (int64) and one float of the loss.
  tests/unit/test_plan_memory.py measures these
  on the real model and holds the formula to the byte.
"""

from __future__ import annotations

from dataclasses import dataclass

ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of each part of the model state."""

    weights: float
    """The copy forward and backward use."""
    grads: float
    optimizer: float
    """Everything the optimizer keeps besides: for mixed precision, the fp32 master weights too."""

    @classmethod
    def zero_paper(cls) -> StateBytes:
        """The ZeRO paper's mixed-precision Adam: fp16 weights and gradients, K = 12 bytes of fp32 state."""
        return cls(2, 2, 12)

    @classmethod
    def adamw(cls, precision: str) -> StateBytes:
        """trainmesh with AdamW: parameters stay fp32 under 32-true and the autocast precisions (bf16-mixed,
        16-mixed), with fp32 gradients and moments; bf16-true keeps all three in bf16."""
        if precision == "bf16-true":
            return cls(2, 2, 4)
        if precision in ("32-true", "bf16-mixed", "16-mixed"):
            return cls(4, 4, 8)
        raise ValueError(f"train.precision={precision!r} is not one of 32-true, bf16-mixed, 16-mixed, bf16-true")


@dataclass(frozen=True)
class ModelStates:
    """Bytes per rank of each part of the model state."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_states(params: int, ranks: int, stage: int, per_param: StateBytes) -> ModelStates:
    """Model-state bytes per rank for `params` parameters over `ranks` data-parallel ranks at ZeRO `stage`."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"ZeRO stage {stage} is not one of {ZERO_STAGES}")
    if params < 0 or ranks < 1:
        raise ValueError(f"need params >= 0 and ranks >= 1, not {params} and {ranks}")

    def share(part: float, partitioned_from: int) -> float:
        return params * part / (ranks if stage >= partitioned_from else 1)

    return ModelStates(
        weights=share(per_param.weights, 3),
        grads=share(per_param.grads, 2),
        optimizer=share(per_param.optimizer, 1),
    )


@dataclass(frozen=True)
class GPTActivations:
    """Bytes autograd holds from forward to backward for one micro-batch of trainmesh's GPT (fp32, SDPA)."""

    per_block: int
    outside: int
    n_layer: int

    @property
    def total(self) -> int:
        return self.n_layer * self.per_block + self.outside


def gpt_activations(n_layer: int, n_head: int, n_embd: int, vocab: int, seq: int, batch: int) -> GPTActivations:
    """Activation bytes of trainmesh's GPT on `batch` sequences of `seq` tokens (no activation checkpointing)."""
    tokens = seq * batch
    fp32, int64 = 4, 8
    per_block = fp32 * tokens * (16 * n_embd + 4 + n_head)
    # the log-softmax, ln_f's and lm_head's inputs, ln_f's mean and rstd; ids, targets, positions; the loss's
    # total weight (one float)
    outside = fp32 * tokens * (vocab + 2 * n_embd + 2) + int64 * (2 * tokens + seq) + fp32
    return GPTActivations(per_block, outside, n_layer)
