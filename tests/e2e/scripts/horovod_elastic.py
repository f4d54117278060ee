"""An elastic Horovod script in the style of Horovod's elastic examples (examples/elastic/pytorch/), on
trainmesh.horovod: hvd.elastic.run over a TorchState, committed after each epoch, with rank 0 saving each commit to a
checkpoint that a restarted job resumes from (torchrun restarts every worker; docs/horovod.md, "hvd.elastic").

    trainmesh run --nproc-per-node 2 --max-restarts 1 horovod_elastic.py OUT EPOCHS [--pause E] [--hold E]

Writes OUT/pid.<rank>.<attempt> as it starts, OUT/checkpoint.pt (with its "history": the (attempt, world size,
epoch) of each commit it descends from) and OUT/final.pt (rank 0: the weights). --pause E: half way through epoch E
each rank writes OUT/paused.<rank>.<world size> and waits until OUT/release exists (so a test can kill a process
there). --hold E: alone, wait after epoch E's commit for another node to join (torchrun then restarts the worker).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import trainmesh.horovod as hvd  # Horovod's: import horovod.torch as hvd

BATCH = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("epochs", type=int)
    parser.add_argument("--pause", type=int, default=0)
    parser.add_argument("--hold", type=int, default=0)
    args = parser.parse_args()
    out = args.out
    hvd.init()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    (out / f"pid.{hvd.rank()}.{attempt}").write_text(str(os.getpid()))
    data = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=data), torch.randn(64, 1, generator=data)
    torch.manual_seed(1 + hvd.rank())  # each rank its own weights: hvd.elastic.run syncs rank 0's
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sampler = hvd.elastic.ElasticSampler(list(range(len(x))), shuffle=True, seed=3)
    # a new optimizer of the same class, as Horovod's: what `optimizer` held is not carried over
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    checkpoint, epoch, history = out / "checkpoint.pt", 0, []
    if hvd.rank() == 0 and checkpoint.exists():  # Horovod's examples resume on rank 0; run() syncs the rest
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        sampler.load_state_dict(saved["sampler"])
        epoch, history = saved["epoch"], saved["history"]
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=epoch)

    def save() -> None:
        if hvd.rank() == 0:  # whole or not at all: a kill mid-write leaves the previous checkpoint
            history.append((int(attempt), hvd.size(), state.epoch))
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": state.epoch}
            torch.save(saved | {"sampler": sampler.state_dict(), "history": history}, out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", checkpoint)

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < args.epochs:
            indices = list(state.sampler)
            batches = [indices[start : start + BATCH] for start in range(0, len(indices), BATCH)]
            for i, batch in enumerate(batches):
                if i == len(batches) // 2 and state.epoch + 1 == args.pause:  # half an epoch a kill now loses
                    (out / f"paused.{hvd.rank()}.{hvd.size()}").touch()
                    deadline = time.monotonic() + 120
                    while not (out / "release").exists() and time.monotonic() < deadline:
                        time.sleep(0.05)
                state.optimizer.zero_grad()
                torch.nn.functional.mse_loss(state.model(x[batch]), y[batch]).backward()
                state.optimizer.step()
                state.sampler.record_batch(i, BATCH)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            save()
            while hvd.size() == 1 and state.epoch == args.hold:
                time.sleep(0.1)  # until torchrun stops this worker to restart it with the node that joins

    train(state)
    if hvd.rank() == 0:
        torch.save(model.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
