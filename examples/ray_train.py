"""trainmesh on Ray Train: Ray starts the workers and their process group, trainmesh trains in it.

    pip install "ray[train]"                         # not a dependency of trainmesh
    python examples/ray_train.py                     # the tiny GPT recipe on 2 CPU workers of a local Ray
    python examples/ray_train.py -- --train.max_steps=20 --optim.lr=1e-3     # config overrides after --
    python examples/ray_train.py --own-loop          # your own loop on trainmesh's Runtime, under Ray
    python examples/ray_train.py --address auto --workers 8 --gpu            # a Ray cluster (`ray start`)

The recipe variant is trainmesh.integrations.ray.fit: the job is resolved once, here on the driver, for Ray's
number of workers, the run folder is claimed and its config written, then every Ray worker runs trainmesh's
worker in the process group Ray set up (adopted, not made again). Only rank 0 writes the run folder, which
must be on storage every worker sees. The own-loop variant shows that a `Runtime` made inside Ray's training
function adopts Ray's group too. See docs/clusters.md ("Ray Train").
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import ray
import ray.train
import torch
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

from trainmesh import Runtime, load_config
from trainmesh.integrations.ray import fit


def own_loop(loop_config: dict[str, Any]) -> None:
    """Ray's training function, written against trainmesh's Runtime: it adopts the group Ray set up."""
    rt = Runtime(strategy="ddp", seed=0)  # rank and world size: Ray's process group's
    gen = torch.Generator().manual_seed(0)  # the same data on every rank; each trains on its own half
    x = torch.randn(1024, 16, generator=gen)
    y = (x @ torch.randn(16, 1, generator=gen)).squeeze(1)
    model = rt.setup(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=loop_config["lr"])
    for epoch in range(loop_config["epochs"]):
        for i in range(rt.rank * 32, len(x), 32 * rt.world_size):  # this rank's micro-batches
            xb, yb = rt.to_device((x[i : i + 32], y[i : i + 32]))
            rt.backward(nn.functional.mse_loss(model(xb).squeeze(1), yb))
            rt.step(optimizer)
            optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            loss = float(rt.all_reduce(nn.functional.mse_loss(model(rt.to_device(x)).squeeze(1), y.to(rt.device))))
        rt.print(f"epoch {epoch}: mse {loss:.4f} (rank {rt.rank} of {rt.world_size}, {rt.strategy.name})")
        ray.train.report({"epoch": epoch, "mse": loss})  # every worker reports: Ray's report is a barrier
    rt.teardown()  # leaves Ray's group alone: Ray destroys it when the workers stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2, help="Ray workers = trainmesh ranks")
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL)")
    parser.add_argument("--address", help="an existing Ray cluster (auto: the local one); default: start Ray here")
    parser.add_argument("--config", default="configs/gpt-tiny.toml")
    parser.add_argument("--own-loop", action="store_true", help="your own loop on Runtime instead of the recipe")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]

    if args.address:
        ray.init(address=args.address)
    else:  # a small local Ray: no dashboard, a small object store (trainmesh passes no data through it)
        ray.init(num_cpus=args.workers, object_store_memory=200 * 2**20, include_dashboard=False)
    scaling = ScalingConfig(num_workers=args.workers, use_gpu=args.gpu)
    if args.own_loop:
        trainer = TorchTrainer(
            own_loop,
            train_loop_config={"lr": 3e-3, "epochs": 3},
            scaling_config=scaling,
            run_config=ray.train.RunConfig(name="ray-own-loop", storage_path=str(Path("runs").absolute())),
        )
        trainer.fit()
        return
    config = load_config(args.config, overrides, "gpt")
    run = fit(config, scaling)
    val = [r for r in run.records() if r["kind"] == "val"]  # the run's metrics.jsonl, written by rank 0
    print(f"run folder: {run.run_dir}; validation loss {val[0]['val_loss']:.4f} -> {val[-1]['val_loss']:.4f}")


if __name__ == "__main__":
    main()
