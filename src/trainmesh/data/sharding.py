"""Which samples each rank reads at each step: deterministic, disjoint and independent of the world size, continued from
a `DataPosition` stored in every checkpoint (exact resume).

Details: docs/internals.md#datashardingpy
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import Sampler

from trainmesh.core.batch import BatchSplit
from trainmesh.core.errors import UserError


class DatasetTooSmallError(UserError, ValueError):
    """Fewer samples than one global batch (or an empty validation set)."""


@dataclass(frozen=True)
class DataPosition:
    """Where in the data the next step starts."""

    epoch: int = 0
    offset: int = 0
    """Samples of epoch `epoch`'s order consumed already."""


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of sample ids), step after step, epoch after epoch."""

    def __init__(
        self,
        num_samples: int,
        split: BatchSplit,
        dp_rank: int,
        seed: int,
        shuffle: bool = True,
        start: DataPosition = DataPosition(),
    ) -> None:
        if num_samples < split.global_batch:
            raise DatasetTooSmallError(
                f"the training set has {num_samples} samples, fewer than one global batch of "
                f"{split.global_batch} ({split.describe()}). Fix: a larger dataset, or a smaller "
                "--train.global_batch / --train.micro_batch."
            )
        assert 0 <= dp_rank < split.dp_size
        self.num_samples = num_samples
        self.split = split
        self.dp_rank = dp_rank
        self.seed = seed
        self.shuffle = shuffle
        if not (start.epoch >= 0 and 0 <= start.offset <= num_samples):
            raise ValueError(f"data position {start} is outside a training set of {num_samples} samples")
        self.start = start
        self.steps_per_epoch = num_samples // split.global_batch  # the ragged tail of an epoch is dropped
        self._order_epoch = -1
        self._order = torch.arange(0)

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """All sample ids in the order epoch `epoch` visits them."""
        if epoch != self._order_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
                self._order = torch.randperm(self.num_samples, generator=gen)
            else:
                self._order = torch.arange(self.num_samples)
            self._order_epoch = epoch
        return self._order

    def position_after(self, steps: int) -> DataPosition:
        """Where the data stands after `steps` steps from `start`."""
        gb, epoch, offset = self.split.global_batch, self.start.epoch, self.start.offset
        left_in_epoch = (self.num_samples - offset) // gb
        if steps <= left_in_epoch:
            return DataPosition(epoch, offset + steps * gb)
        epochs, index = divmod(steps - left_in_epoch, self.steps_per_epoch)
        if index == 0:  # the last of those steps ended an epoch; the next one starts the following epoch
            return DataPosition(epoch + epochs, self.steps_per_epoch * gb)
        return DataPosition(epoch + 1 + epochs, index * gb)

    def global_batch_ids(self, step: int) -> torch.Tensor:
        """The ids every rank together consumes at the `step`-th step from `start`, in micro-batch order."""
        position = self.position_after(step)
        epoch, offset = position.epoch, position.offset
        if offset + self.split.global_batch > self.num_samples:  # the ragged end: the next epoch begins
            epoch, offset = epoch + 1, 0
        return self.epoch_order(epoch)[offset : offset + self.split.global_batch]

    def micro_batches(self, step: int) -> list[list[int]]:
        """This rank's `accum_steps` micro-batches for the `step`-th step from `start`."""
        chunks = self.global_batch_ids(step).view(-1, self.split.micro_batch)  # (global/micro, micro)
        mine = chunks[self.dp_rank :: self.split.dp_size]  # (accum_steps, micro)
        return mine.tolist()

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while True:
            yield from self.micro_batches(step)
            step += 1

    def __len__(self) -> int:  # one epoch's worth; the iterator itself never ends
        return self.steps_per_epoch * self.split.accum_steps


def position_at_step(step: int, global_batch: int, num_samples: int) -> DataPosition:
    """The data position after `step` steps of `global_batch` from the start (checkpoints written before
    the position was recorded hold only the step)."""
    epoch, index = divmod(step, max(1, num_samples // global_batch))  # too few samples: the sampler says so
    return DataPosition(epoch, index * global_batch)


def eval_micro_batches(
    num_samples: int, eval_samples: int, micro_batch: int, dp_rank: int, dp_size: int
) -> list[list[int]]:
    """This rank's share of a fixed validation slice: samples 0..eval_samples-1 (all, if fewer exist)
    cut into micro-batches dealt round-robin to the ranks. The slice does not depend on the number of
    ranks, so validation losses compare across world sizes. Every rank gets as many entries as the
    busiest: a short share is padded with empty ones, each meaning "run a throwaway forward", since a
    sharded model's forward is collective and every rank must run the same number."""
    if num_samples < 1:
        raise DatasetTooSmallError(
            "the validation set is empty. Fix: a larger data.val_fraction or corpus, or a smaller model.block_size."
        )
    chunks = torch.arange(min(eval_samples, num_samples)).split(micro_batch)
    mine: list[list[int]] = [chunk.tolist() for chunk in chunks[dp_rank::dp_size]]
    return mine + [[] for _ in range(math.ceil(len(chunks) / dp_size) - len(mine))]
