"""Async checkpoints: how long training stalls for a save, blocking vs `checkpoint.async_save`.

Each of 2 gloo ranks holds a GPT with AdamW state (the state a real run checkpoints), wrapped in DDP.
Rounds alternate: a blocking save (`Checkpointer(background=False).save`, which returns once the
checkpoint is committed), then an async save, whose stall is the time until `save` returns and training
can continue; its background write is timed too, as is a plain `torch.save` of the same state on each
rank (the PyTorch baseline). Figures are medians over rounds, the slower rank's time each round.
The figure of merit is the async stall / the blocking save; target <= 0.10.

    python benchmarks/checkpoint_stall.py [--size small --rounds 5 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from trainmesh.checkpoint import Checkpointer, TrainerState
from trainmesh.launch.spawn import run_distributed
from trainmesh.recipes.gpt.model import GPT, GPTConfig
from trainmesh.runtime.runtime import Runtime

TARGET = 0.10


def rank_main(rank: int, size: str, rounds: int, folder: str) -> dict[str, Any]:
    del rank
    rt = Runtime(strategy="ddp")
    raw = GPT(GPTConfig(size=size, vocab_size=50304, block_size=256))
    model = rt.setup(raw)
    optimizer = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    x = torch.randint(0, 50304, (2, 64))
    loss = model(x).float().pow(2).mean()
    loss.backward()
    optimizer.step()  # creates the optimizer state
    blocking = Checkpointer(Path(folder) / "blocking", rt)
    background = Checkpointer(Path(folder) / "async", rt, background=True)
    times: dict[str, list[float]] = {"blocking": [], "async_stall": [], "async_write": [], "torch_save": []}
    for step in range(1, rounds + 1):
        state = TrainerState(step=step, world_size=rt.world_size)
        rt.barrier()
        start = time.perf_counter()
        blocking.save(model, optimizer, state)
        times["blocking"].append(time.perf_counter() - start)
        rt.barrier()
        start = time.perf_counter()
        background.save(model, optimizer, state)
        times["async_stall"].append(time.perf_counter() - start)
        with torch.no_grad():  # training goes on and changes the weights in place meanwhile
            for p in raw.parameters():
                p.mul_(0.999)
        background.wait()
        times["async_write"].append(time.perf_counter() - start)
        rt.barrier()
        start = time.perf_counter()
        torch.save({"model": raw.state_dict(), "optim": optimizer.state_dict()}, Path(folder) / f"plain_{rt.rank}.pt")
        times["torch_save"].append(time.perf_counter() - start)
    background.close()
    params = sum(p.numel() for p in raw.parameters())
    return {"params": params, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="small", help="GPT size (model.size): tiny | small | gpt2 ...")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        ranks = run_distributed(rank_main, 2, (args.size, args.rounds, folder), timeout_s=1800)
    params = ranks[0]["params"]
    slowest = {k: [max(r["times"][k][i] for r in ranks) for i in range(args.rounds)] for k in ranks[0]["times"]}
    medians = {k: statistics.median(v) for k, v in slowest.items()}
    ratio = medians["async_stall"] / medians["blocking"]
    print(f"GPT {args.size}: {params / 1e6:.1f}M parameters + AdamW state, 2 gloo ranks, {args.rounds} rounds")
    print(f"  blocking save (committed)      {medians['blocking'] * 1000:8.1f} ms")
    print(f"  async save: training stall     {medians['async_stall'] * 1000:8.1f} ms")
    print(f"  async save: until committed    {medians['async_write'] * 1000:8.1f} ms")
    print(f"  plain torch.save, every rank   {medians['torch_save'] * 1000:8.1f} ms")
    print(f"  stall ratio async / blocking   {ratio:8.3f}   (target <= {TARGET})")
    if args.json:
        result = {"size": args.size, "params": params, "median_s": medians, "ratio": ratio, "target": TARGET}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
