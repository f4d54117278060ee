"""The train/validation split of a token stream: every k-th block of 65,536 tokens is validation, the same split for any
number of workers.

Details: docs/internals.md#datasplitpy
"""

from __future__ import annotations

import numpy as np

from trainmesh.core.errors import UserError
from trainmesh.data.shards import ShardWriter

VAL_BLOCK_TOKENS = 1 << 16


class CorpusTooSmallError(UserError, ValueError):
    """Too few tokens to give both train and val some."""


class TrainValSplit:
    """Routes a token stream to the train and val shard writers, counting the documents that start in each."""

    def __init__(self, val_fraction: float, train: ShardWriter, val: ShardWriter) -> None:
        assert 0 < val_fraction < 1, val_fraction
        self.val_fraction = val_fraction
        self.every = max(2, round(1 / val_fraction))
        self.writers = {"train": train, "val": val}
        self.documents = {"train": 0, "val": 0}
        self.tokens = 0
        self._held: list[np.ndarray] | None = []  # train blocks before the first val block; None once written
        self._held_starts: list[int] = []  # positions of the documents that start in them

    def feed(self, tokens: np.ndarray, document_starts: np.ndarray) -> None:
        """The next tokens of the stream; `document_starts`: offsets into `tokens` where documents start."""
        done = 0
        while done < len(tokens):
            block, within = divmod(self.tokens, VAL_BLOCK_TOKENS)
            size = min(VAL_BLOCK_TOKENS - within, len(tokens) - done)
            split = "val" if block % self.every == self.every - 1 else "train"
            starts = document_starts[(document_starts >= done) & (document_starts < done + size)]
            if split == "val" and self._held is not None:
                self._release_held()
            if self._held is not None:
                self._held.append(tokens[done : done + size])
                self._held_starts += (starts - done + self.tokens).tolist()
            else:
                self.writers[split].write(tokens[done : done + size])
                self.documents[split] += len(starts)
            self.tokens += size
            done += size

    def finish(self) -> None:
        """Write what is held: a corpus that ended before its first val block gives its tail to val."""
        if self._held is None:
            return
        if self.tokens < 2:
            raise CorpusTooSmallError(
                f"the inputs hold {self.tokens} token(s): too few for a train and a validation split. "
                "Fix: give more text."
            )
        held = np.concatenate(self._held)
        val = min(max(1, round(self.tokens * self.val_fraction)), self.tokens - 1)
        boundary = self.tokens - val
        self.writers["train"].write(held[:boundary])
        self.writers["val"].write(held[boundary:])
        starts = np.array(self._held_starts, dtype=np.int64)
        self.documents["train"] += int((starts < boundary).sum())
        self.documents["val"] += int((starts >= boundary).sum())
        self._held = None

    def _release_held(self) -> None:
        assert self._held is not None
        for part in self._held:
            self.writers["train"].write(part)
        self.documents["train"] += len(self._held_starts)
        self._held, self._held_starts = None, []
