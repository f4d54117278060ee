"""Model speed: trainmesh's GPT training step vs the plainest GPT of the same shape, in one process.

Both sides run the same step on the same random tokens: forward with the loss, backward and AdamW (the same
hyperparameters and two weight-decay groups), no framework around it. The plain side is nanoGPT's
model.py in one file (benchmarks/plain_gpt.py: one fused q/k/v projection, split q | k | v). Rounds are
interleaved (trainmesh, plain, trainmesh, plain, ...) with the same number of threads; the first
`--warmup` steps of every round are dropped. Figure: median(trainmesh step) / median(plain step), pooled
over the rounds; target <= 1.02.

    python benchmarks/model_step.py [--size tiny --rounds 8 --steps 30 --warmup 3 --threads 1 --json out.json]

Shapes: tiny (4 layers, 128 wide, vocab 256, 8 × 128 tokens per step) and gpt2 (GPT-2 124M: 12 layers,
768 wide, vocab 50304, 1 × 256 tokens per step on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from plain_gpt import PlainConfig, PlainGPT
from trainmesh.config.schema import OptimConfig
from trainmesh.recipes.gpt.model import GPT, GPTConfig, summed_lm_loss
from trainmesh.train.optim import build_optimizer

TARGET = 1.02
# size: (model.size, vocab, batch, block_size)
SHAPES = {"tiny": ("tiny", 256, 8, 128), "gpt2": ("gpt2", 50304, 1, 256)}

Step = Callable[[], None]


def trainmesh_step(cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> Step:
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = build_optimizer(model, OptimConfig(), torch.device("cpu"))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        (summed_lm_loss(model(x), y) / y.numel()).backward()
        optimizer.step()

    return step


def plain_step(cfg: GPTConfig, x: torch.Tensor, y: torch.Tensor) -> Step:
    torch.manual_seed(0)
    model = PlainGPT(PlainConfig(cfg.block_size, cfg.vocab_size, cfg.n_layer, cfg.n_head, cfg.n_embd, 0.0, cfg.bias))
    opt = OptimConfig()
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        optimizer.step()

    return step


def timed(step: Step, steps: int, warmup: int) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(1000 * (time.perf_counter() - t0))
    return times[warmup:]


def stats(ms: list[float]) -> dict[str, float]:
    p10, median, p90 = np.percentile(ms, [10, 50, 90])
    return {"median_ms": float(median), "p10_ms": float(p10), "p90_ms": float(p90)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    size, vocab, batch, block = SHAPES[args.size]
    cfg = GPTConfig(size=size, vocab_size=vocab, block_size=block, dropout=0.0)
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randint(vocab, (batch, block), generator=gen) for _ in range(2))
    sides = {"trainmesh": trainmesh_step(cfg, x, y), "plain": plain_step(cfg, x, y)}
    pooled: dict[str, list[float]] = {name: [] for name in sides}
    rounds = []
    for r in range(args.rounds):
        medians = {}
        for name, step in sides.items():
            ms = timed(step, args.steps, args.warmup)
            pooled[name] += ms
            medians[name] = float(np.median(ms))
        rounds.append(medians["trainmesh"] / medians["plain"])
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in medians.items()), flush=True)
    tm, pl = stats(pooled["trainmesh"]), stats(pooled["plain"])
    return {
        "size": args.size,
        "shape": {"n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "vocab": vocab, "batch": batch, "block_size": block},
        "threads": args.threads,
        "steps_each": len(pooled["trainmesh"]),
        "trainmesh": tm,
        "plain": pl,
        "ratio": tm["median_ms"] / pl["median_ms"],
        "round_ratios": rounds,
        "torch": torch.__version__,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SHAPES), default="tiny", help="model shape")
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds (each: trainmesh, then plain)")
    parser.add_argument("--steps", type=int, default=30, help="steps per side per round")
    parser.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of every round")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--json", help="also write the results as JSON here")
    args = parser.parse_args()
    if args.rounds < 1 or not 0 <= args.warmup < args.steps:
        parser.error("need --rounds >= 1 and 0 <= --warmup < --steps")
    torch.set_num_threads(args.threads)
    result = measure(args)
    tm, pl = result["trainmesh"], result["plain"]
    print(
        f"\n{args.size}: trainmesh {tm['median_ms']:.2f} ms (p10-p90 {tm['p10_ms']:.2f}-{tm['p90_ms']:.2f}), "
        f"plain {pl['median_ms']:.2f} ms (p10-p90 {pl['p10_ms']:.2f}-{pl['p90_ms']:.2f}), "
        f"{result['steps_each']} steps each\nratio {result['ratio']:.3f} (target <= {TARGET}); per round "
        f"{min(result['round_ratios']):.3f}-{max(result['round_ratios']):.3f}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
