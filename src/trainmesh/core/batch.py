"""Batch arithmetic: global batch = micro-batch × accumulation steps × data-parallel ranks, refused before launch when
it does not divide; and the loss normalisation that makes the accumulated gradient exactly the global mean's.

Details: docs/internals.md#corebatchpy
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class BatchMathError(ValueError):
    """A global batch that cannot be split into whole micro-batches across the ranks."""


@dataclass(frozen=True)
class BatchSplit:
    global_batch: int
    """Samples per optimizer step, over all ranks."""
    micro_batch: int
    """Samples per process per forward/backward."""
    dp_size: int
    """Data-parallel replicas."""
    accum_steps: int
    """Micro-steps per optimizer step on each rank."""
    tokens_per_sample: int = 0
    """Tokens in one sample (sequence length) for token recipes; 0 otherwise."""

    @classmethod
    def derive(
        cls,
        *,
        micro_batch: int,
        dp_size: int,
        global_batch: int = 0,
        global_batch_tokens: int = 0,
        tokens_per_sample: int = 0,
        other_dp_sizes: Sequence[int] = (),
    ) -> BatchSplit:
        """The split at `dp_size` replicas for train.micro_batch, train.global_batch (0: no accumulation) and
        train.global_batch_tokens (0: unset). `other_dp_sizes`: the sizes the same job may also run at (an
        elastic node range), so that a suggested fix divides at every one of them."""
        micro = micro_batch
        per_micro_step = micro * dp_size
        source = f"train.global_batch={global_batch}"
        global_batch = global_batch or per_micro_step
        if global_batch_tokens:
            if not tokens_per_sample:
                raise BatchMathError(
                    "train.global_batch_tokens is only meaningful for token recipes; "
                    "use train.global_batch (in samples) instead."
                )
            if global_batch_tokens % tokens_per_sample:
                lower = global_batch_tokens // tokens_per_sample * tokens_per_sample
                raise BatchMathError(
                    f"train.global_batch_tokens={global_batch_tokens} is not a whole number of "
                    f"sequences of {tokens_per_sample} tokens (model.block_size): "
                    f"{global_batch_tokens} / {tokens_per_sample} = "
                    f"{global_batch_tokens / tokens_per_sample:.2f}. "
                    f"Fix: --train.global_batch_tokens={lower} or {lower + tokens_per_sample}."
                )
            global_batch = global_batch_tokens // tokens_per_sample
            source = (
                f"train.global_batch_tokens={global_batch_tokens} "
                f"(= {global_batch} sequences × {tokens_per_sample} tokens)"
            )
        if global_batch % per_micro_step:
            sizes = sorted({dp_size, *other_dp_sizes})
            step = math.lcm(*(micro * d for d in sizes))  # a global batch that splits at every size
            lower = max(step, global_batch // step * step)
            if global_batch_tokens:  # suggest the key the user actually set
                unit, key, scale = "tokens", "train.global_batch_tokens", tokens_per_sample
            else:
                unit, key, scale = "samples", "train.global_batch", 1
            every = f" at every data-parallel size this job may run at ({', '.join(map(str, sizes))})"
            raise BatchMathError(
                f"{source} cannot be split evenly: each micro-step processes train.micro_batch={micro} "
                f"× {dp_size} data-parallel rank(s) = {per_micro_step} samples, and "
                f"{global_batch} / {per_micro_step} = {global_batch / per_micro_step:.2f} is not a whole "
                f"number of accumulation steps. Fix: a global batch that is a multiple of "
                f"{step * scale} {unit}{every if len(sizes) > 1 else ''} (e.g. --{key}={lower * scale} or "
                f"{(lower + step) * scale}), or change --train.micro_batch or the number of processes."
            )
        return cls(global_batch, micro, dp_size, global_batch // per_micro_step, tokens_per_sample)

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.tokens_per_sample

    def describe(self) -> str:
        text = (
            f"global batch {self.global_batch} samples = micro-batch {self.micro_batch} "
            f"× {self.accum_steps} accumulation step(s) × {self.dp_size} data-parallel rank(s)"
        )
        if self.tokens_per_sample:
            text += f" = {self.tokens_per_step:,} tokens per step"
        return text


def loss_scale(global_target_count: float, dp_size: int) -> float:
    """Factor that turns a micro-batch's summed loss into its share of the global mean (see above)."""
    if global_target_count <= 0:
        raise ValueError("the global batch holds no targets (every label is ignore_index?)")
    return dp_size / global_target_count
