"""Horovod's PyTorch MNIST example (horovod/examples/pytorch/pytorch_mnist.py) on synthetic digits, changed in
one line for trainmesh: the import of hvd. Nothing else here knows about trainmesh.

    trainmesh run --nproc-per-node 2 examples/horovod_mnist_style.py --epochs 2
    trainmesh horovodrun -np 2 python examples/horovod_mnist_style.py --epochs 2 --fp16-allreduce
    python examples/horovod_mnist_style.py                    # one process

The structure is Horovod's: hvd.init(), one thread per worker, a DistributedSampler over hvd.size() ranks,
the learning rate scaled by hvd.size(), parameters and optimizer state broadcast from rank 0, a
DistributedOptimizer (optionally with fp16 compression), and test metrics averaged with hvd.allreduce.
The data are made here, so nothing is downloaded: each class is a fixed random 28x28 pattern, and a sample
is its class's pattern plus noise.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import torch.utils.data.distributed
from torch import nn, optim
from torch.utils.data import TensorDataset

import trainmesh.horovod as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST Example (Horovod, synthetic data)")
parser.add_argument("--batch-size", type=int, default=64, help="input batch size for training (default: 64)")
parser.add_argument("--test-batch-size", type=int, default=256, help="input batch size for testing (default: 256)")
parser.add_argument("--epochs", type=int, default=2, help="number of epochs to train (default: 2)")
parser.add_argument("--lr", type=float, default=0.01, help="learning rate (default: 0.01)")
parser.add_argument("--momentum", type=float, default=0.5, help="SGD momentum (default: 0.5)")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
parser.add_argument("--log-interval", type=int, default=10, help="batches between training log lines")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression in allreduce")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0, help="gradient predivide factor")
parser.add_argument("--train-samples", type=int, default=4096, help="synthetic training samples (default: 4096)")
parser.add_argument("--test-samples", type=int, default=1024, help="synthetic test samples (default: 1024)")
parser.add_argument("--save-model", default=None, help="rank 0 saves the final state_dict here")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, 1, 28, 28)
        x = F.relu(F.max_pool2d(self.conv1(x), 2))  # (B, 10, 12, 12)
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))  # (B, 20, 4, 4)
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)  # (B, 10)


def synthetic_mnist(samples: int, split: int) -> TensorDataset:
    """`samples` noisy 28x28 images of 10 classes, the same on every rank (own generator: the global RNG, which
    the model's initialisation and dropout use, is left alone). `split` 0: training set, 1: test set."""
    patterns = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1000 + split)
    labels = torch.randint(0, 10, (samples,), generator=gen)
    images = patterns[labels] + torch.randn(samples, 1, 28, 28, generator=gen)
    return TensorDataset(images, labels)


def metric_average(val: torch.Tensor, name: str) -> float:
    avg_tensor = hvd.allreduce(val.detach().clone(), name=name)
    return avg_tensor.item()


def train(args: argparse.Namespace) -> None:
    # Horovod: initialize library.
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    # Horovod: limit # of CPU threads to be used per worker.
    torch.set_num_threads(1)
    device = torch.device("cuda", hvd.local_rank()) if args.cuda else torch.device("cpu")

    train_dataset = synthetic_mnist(args.train_samples, split=0)
    # Horovod: use DistributedSampler to partition the training data.
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = synthetic_mnist(args.test_samples, split=1)
    # Horovod: use DistributedSampler to partition the test data.
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank()
    )
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net().to(device)
    # Horovod: scale learning rate by the number of workers.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=compression,
        op=hvd.Average,
        gradient_predivide_factor=args.gradient_predivide_factor,
    )

    def train_epoch(epoch: int) -> None:
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            data, target = data.to(device), target.to(device)
            optimizer.zero_grad()
            output = model(data)
            loss = F.nll_loss(output, target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                # Horovod: use train_sampler to determine the number of examples in this worker's partition.
                done = batch_idx * len(data)
                print(
                    f"Train Epoch: {epoch} [{done}/{len(train_sampler)} "
                    f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}"
                )

    def test() -> None:
        model.eval()
        test_loss = torch.zeros(())
        test_accuracy = torch.zeros(())
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(device), target.to(device)
                output = model(data)
                # sum up batch loss
                test_loss += F.nll_loss(output, target, reduction="sum").cpu()
                # get the index of the max log-probability
                pred = output.max(1, keepdim=True)[1]
                test_accuracy += pred.eq(target.view_as(pred)).cpu().float().sum()

        # Horovod: use test_sampler to determine the number of examples in this worker's partition.
        test_loss /= len(test_sampler)
        test_accuracy /= len(test_sampler)

        # Horovod: average metric values across workers.
        avg_loss = metric_average(test_loss, "avg_loss")
        avg_accuracy = metric_average(test_accuracy, "avg_accuracy")

        # Horovod: print output only on first rank.
        if hvd.rank() == 0:
            print(f"\nTest set: Average loss: {avg_loss:.4f}, Accuracy: {100.0 * avg_accuracy:.2f}%\n")

    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        test()

    if args.save_model and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save_model)


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    train(args)
