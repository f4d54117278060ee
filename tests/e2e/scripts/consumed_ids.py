"""A `trainmesh run` script: the nano GPT on 40 training windows that carry their sample id. Every rank
appends the ids of each micro-batch it trains on to `<run>/consumed/rank_<r>.jsonl`, tagged with the
attempt (torchrun's restart count), so a test can compare what each attempt consumed with a reference.

    trainmesh run tests/e2e/scripts/consumed_ids.py --config nano.toml --run-dir runs/x
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from trainmesh.config import Config
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.recipes.base import Datasets
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.runtime.runtime import Runtime

TRAIN_SAMPLES = 40


class IdTagged(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, inner: Any, size: int) -> None:
        self.inner, self.size = inner, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        x, y = self.inner[index]
        return x, y, index


class IdLoggingRecipe(GPTRecipe):
    def __init__(self, log_dir: Path) -> None:
        super().__init__()
        self.log_file = log_dir / f"rank_{os.environ['RANK']}.jsonl"
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def prepare(self, config: Config, runtime: Runtime) -> Datasets:
        train, val = super().prepare(config, runtime)
        return Datasets(IdTagged(train, TRAIN_SAMPLES), val)

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        if len(batch) == 3:  # a training micro-batch (validation batches carry no ids)
            x, y, ids = batch
            with self.log_file.open("a") as f:
                f.write(json.dumps({"attempt": self.attempt, "ids": ids.tolist()}) + "\n")
            batch = (x, y)
        return super().split_batch(batch)

    def count_targets(self, batch: Any) -> int:
        return super().count_targets(batch[:2])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", required=True)
    parser.add_argument("--run-dir", required=True)
    args, overrides = parser.parse_known_args()
    run_dir = Path(args.run_dir)
    (run_dir / "consumed").mkdir(parents=True, exist_ok=True)
    config = load_config(args.config, overrides, "gpt")
    run_worker(config, run_dir, recipe=IdLoggingRecipe(run_dir / "consumed"))


if __name__ == "__main__":
    main()
