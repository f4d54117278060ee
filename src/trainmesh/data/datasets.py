"""Datasets over token shards: fixed-length windows (x, y = x shifted by one) for language models."""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from trainmesh.data.corpus import load_tokens


class TokenWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size + 1` tokens over one or more shards.

    Sample i is a fixed slice of a fixed shard, so a sample id names the same text on every rank and
    in every run. Shards are memory-mapped lazily, which keeps the dataset cheap to send to workers.
    """

    def __init__(self, shards: tuple[Path, ...], block_size: int) -> None:
        self.shards = shards
        self.block_size = block_size
        counts = [max(0, (len(load_tokens(p)) - 1) // block_size) for p in shards]
        self._starts = np.cumsum([0, *counts]).tolist()  # first sample id of each shard
        self._tokens: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"sample {index} is outside 0..{len(self) - 1}")
        if self._tokens is None:
            self._tokens = [load_tokens(p) for p in self.shards]
        shard = bisect.bisect_right(self._starts, index) - 1
        start = (index - self._starts[shard]) * self.block_size
        window = torch.from_numpy(self._tokens[shard][start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]  # (T,), (T,)
