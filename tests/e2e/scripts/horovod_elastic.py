"""A Horovod elastic script as Horovod's elastic examples write one (examples/elastic/pytorch/), changed only in its
import: hvd.elastic.run over a TorchState, committed after each epoch, with rank 0 saving each commit to a
checkpoint that a restarted job resumes from (torchrun restarts every worker; docs/horovod.md, "hvd.elastic").

    trainmesh run --nproc-per-node 2 --max-restarts 1 horovod_elastic.py OUT EPOCHS PAUSE

Writes OUT/pid.<rank>.<attempt> as it starts, OUT/epochs.log (rank 0: attempt, world size, epoch committed, after
each save), OUT/checkpoint.pt (its "history": the (world size, epoch) of each commit it descends from) and
OUT/final.pt (rank 0: the weights). PAUSE: seconds to sleep half way through each epoch.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch

import trainmesh.horovod as hvd  # was: import horovod.torch as hvd

BATCH = 8


def main() -> None:
    out, epochs, pause = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
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
            history.append((hvd.size(), state.epoch))
            saved = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": state.epoch}
            torch.save(saved | {"sampler": sampler.state_dict(), "history": history}, out / "checkpoint.tmp")
            os.replace(out / "checkpoint.tmp", checkpoint)
            with open(out / "epochs.log", "a") as log:
                log.write(f"{attempt} {hvd.size()} {state.epoch}\n")

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        while state.epoch < epochs:
            indices = list(state.sampler)
            for i, start in enumerate(range(0, len(indices), BATCH)):
                batch = indices[start : start + BATCH]
                state.optimizer.zero_grad()
                torch.nn.functional.mse_loss(state.model(x[batch]), y[batch]).backward()
                state.optimizer.step()
                state.sampler.record_batch(i, BATCH)
                if start == len(indices) // 2 // BATCH * BATCH:
                    time.sleep(pause)  # half an epoch that a kill now loses
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            save()

    train(state)
    if hvd.rank() == 0:
        torch.save(model.state_dict(), out / "final.pt")


if __name__ == "__main__":
    main()
