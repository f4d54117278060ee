"""examples/horovod_mnist_style.py written for plain PyTorch DDP: the same model, data, sampler, seed, optimizer
and loop (and the same draws from the global RNG: data loaders and dropout), with DistributedDataParallel and
torch.distributed instead of hvd. The e2e test runs both under `trainmesh run` and compares the weights.

    trainmesh run --nproc-per-node 2 tests/e2e/scripts/ddp_mnist_style.py --epochs 2 --save-model ddp.pt
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import optim
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
import horovod_mnist_style as example  # the example's Net, data and flags


def main() -> None:
    args = example.parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = example.synthetic_mnist(args.train_samples, split=0)
    train_sampler = DistributedSampler(train_dataset, num_replicas=world, rank=rank)
    train_loader = DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = example.synthetic_mnist(args.test_samples, split=1)
    test_sampler = DistributedSampler(test_dataset, num_replicas=world, rank=rank)
    test_loader = DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = DistributedDataParallel(example.Net())
    optimizer = optim.SGD(model.parameters(), lr=args.lr * world, momentum=args.momentum)

    for epoch in range(1, args.epochs + 1):
        model.train()
        train_sampler.set_epoch(epoch)
        for data, target in train_loader:
            optimizer.zero_grad()
            F.nll_loss(model(data), target).backward()
            optimizer.step()
        model.eval()
        totals = torch.zeros(2)  # (loss sum, correct) over this rank's test samples
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                totals[0] += F.nll_loss(output, target, reduction="sum")
                totals[1] += output.argmax(1).eq(target).float().sum()
        totals /= len(test_sampler)
        dist.all_reduce(totals)
        if rank == 0:
            print(f"\nTest set: Average loss: {totals[0] / world:.4f}, Accuracy: {100.0 * totals[1] / world:.2f}%\n")

    if args.save_model and rank == 0:
        torch.save(model.module.state_dict(), args.save_model)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
