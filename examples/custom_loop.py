"""Your own training loop on trainmesh's Runtime — no recipe, no config file.

    python examples/custom_loop.py                            # one process
    trainmesh run examples/custom_loop.py --epochs 3          # 2 CPU processes / all GPUs
    torchrun --nproc-per-node 2 examples/custom_loop.py       # plain torchrun works too

A small MLP learns a synthetic classification task. Runtime reads RANK/WORLD_SIZE, picks the device and
backend, wraps the model in DDP when there are several processes, and shards the data.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainmesh import Runtime


def make_data(n: int = 4096, dim: int = 32, classes: int = 4) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)  # the same data on every rank
    x = torch.randn(n, dim, generator=gen)
    teacher = torch.randn(dim, classes, generator=gen)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per process, per micro-step")
    parser.add_argument("--accum", type=int, default=2, help="micro-steps per optimizer step")
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    rt = Runtime(precision=args.precision, seed=0)
    rt.print(f"rank {rt.rank}/{rt.world_size} on {rt.device}, strategy {rt.strategy.name}")

    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.setup_dataloader(DataLoader(make_data(), batch_size=args.batch_size, shuffle=True, drop_last=True))

    for epoch in range(args.epochs):
        loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]  # a fresh shuffle per epoch
        total = torch.zeros(2, device=rt.device)  # (loss sum, samples)
        for i, batch in enumerate(loader):
            x, y = rt.to_device(batch)
            last = (i + 1) % args.accum == 0
            with rt.no_sync(model, enabled=not last), rt.autocast():
                loss = nn.functional.cross_entropy(model(x), y)
            rt.backward(loss / args.accum)  # equal-size micro-batches: dividing by accum is exact here
            if last:
                rt.clip_grad_norm(model, optimizer, max_norm=1.0)
                rt.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach().float() * len(y), torch.tensor(float(len(y)), device=rt.device)])
        loss_sum, count = rt.all_reduce(total, "sum").tolist()
        rt.print(f"epoch {epoch}: mean loss {loss_sum / count:.4f} over {int(count)} samples")
    rt.teardown()


if __name__ == "__main__":
    main()
