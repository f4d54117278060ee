"""Pipeline bubble: how long each stage sits idle per step, measured, against the theory.

Two gloo processes on the CPU (1 thread each, `trainmesh.launch.spawn.run_distributed`) form a pipeline of
p = 2 ranks. For each schedule and micro-batch count m, trainmesh's own pipeline strategy
(`build_strategy(Layout("single", ParallelDims(pp=2)), parallel=ParallelConfig(pp=2,
pipeline=PipelineConfig(schedule, m)))`) cuts a GPT (8 blocks, C = 256, T = 64) into stages, and
`strategy.forward_backward` runs whole steps of m micro-batches of 2
sequences each (`--rows`). Every stage's compute — the `forward_one_chunk`, `backward_one_chunk` and
`backward_weight_one_chunk` calls of torch's PipelineStage — is timed; a step starts after a barrier.

    idle fraction of a rank = 1 − (its compute time in the step) / (the step's wall time)

median over the measured steps, per rank. The theory for p ranks, m micro-batches and equal stages:

    GPipe, 1F1B            (p − 1) / (m + p − 1)
    interleaved (v stages per rank: interleaved_1f1b, looped_bfs)   (p − 1) / (v·m + p − 1)

The zero-bubble schedules split the backward into input and weight gradients to fill the bubble;
their ideal is close to 0 for m ≥ 2p, which the table shows as measured only. Communication,
Python scheduling and the imbalance between stages (the first holds the embeddings, the last the head
and the loss) all count as idle, so a measurement sits a little above its theory.

    OMP_NUM_THREADS=1 python benchmarks/pipeline_bubble.py [--schedules gpipe,1f1b --micro-batches 1,2,4,8
        --rows 2 --steps 6] [--json docs/pipeline_bubble.json --plot docs/pipeline_bubble.png]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainmesh.config.schema import ParallelConfig, PipelineConfig
from trainmesh.launch.spawn import run_distributed
from trainmesh.precision import build_precision
from trainmesh.recipes.gpt.model import GPT, GPTConfig, summed_lm_loss
from trainmesh.recipes.gpt.parallel import pipeline_stage_gpt
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import Layout, Objective, ParallelDims, ParallelPlan, build_strategy
from trainmesh.strategies.pipeline import PipelineStrategy

P = 2
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zero_bubble", "zbv_zero_bubble")
MICRO_BATCHES = (1, 2, 4, 8, 16)
STAGES_PER_RANK = {"interleaved_1f1b": 2, "looped_bfs": 2, "interleaved_zero_bubble": 2, "zbv_zero_bubble": 2}
TIMED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


def theory(schedule: str, m: int) -> float | None:
    if "zero_bubble" in schedule:
        return None
    v = STAGES_PER_RANK.get(schedule, 1)
    return (P - 1) / (v * m + P - 1)


def _timed(busy: list[float], method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            busy[0] += time.perf_counter() - start

    return wrapper


def rank_main(
    rank: int, schedules: list[str], micro_batches: list[int], rows: int, steps: int, warmup: int
) -> list[dict[str, Any]]:
    runtime = Runtime(strategy="single", parallel=ParallelConfig(pp=P, pipeline=PipelineConfig("gpipe", 1)))
    cfg = GPTConfig(size="small", n_layer=8, n_head=4, n_embd=256, block_size=64, vocab_size=256)
    objective = Objective(lambda b: (b[0], b[1]), summed_lm_loss, lambda o, t: {"loss": summed_lm_loss(o, t)})
    precision = build_precision("32-true", runtime.device)
    results = []
    for schedule in schedules:
        for m in micro_batches:
            try:
                strategy = build_strategy(
                    Layout("single", ParallelDims(pp=P)),
                    env=runtime.env,
                    device=runtime.device,
                    parallel=ParallelConfig(pp=P, pipeline=PipelineConfig(schedule, m)),
                )
                assert isinstance(strategy, PipelineStrategy)
                torch.manual_seed(0)
                model = strategy.setup_module(GPT(cfg), ParallelPlan(pipeline_stage=pipeline_stage_gpt))
            except ValueError as e:  # a schedule that needs more micro-batches
                results.append({"schedule": schedule, "m": m, "skipped": str(e).splitlines()[0]})
                continue
            busy = [0.0]
            for stage in strategy.pipeline_stages:
                for name in TIMED:
                    if hasattr(stage, name):
                        setattr(stage, name, _timed(busy, getattr(stage, name)))
            generator = torch.Generator().manual_seed(1)
            batch = torch.randint(0, cfg.vocab_size, (m * rows, cfg.block_size + 1), generator=generator)
            x, y = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
            scale = 1.0 / y.numel()  # the mean over the batch's tokens
            idle = []
            for step in range(warmup + steps):
                dist.barrier()
                busy[0] = 0.0
                start = time.perf_counter()
                strategy.forward_backward(model, (x, y), objective, lambda s=scale: s, precision)
                wall = time.perf_counter() - start
                model.zero_grad(set_to_none=True)
                if step >= warmup:
                    idle.append(1.0 - busy[0] / wall)
            median = statistics.median(idle)
            results.append({"schedule": schedule, "m": m, "idle": median, "theory": theory(schedule, m)})
    runtime.teardown()
    return results


def plot(rows: list[dict[str, Any]], path: Path, per_micro_batch: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for i, schedule in enumerate(dict.fromkeys(r["schedule"] for r in rows)):
        mine = [r for r in rows if r["schedule"] == schedule and "idle" in r]
        color = f"C{i}"
        ax.plot([r["m"] for r in mine], [r["idle"] for r in mine], "o-", color=color, label=f"{schedule} measured")
        known = [r for r in mine if r["theory"] is not None]
        if known and schedule in ("gpipe", "interleaved_1f1b"):  # 1f1b and looped_bfs share these curves
            ax.plot([r["m"] for r in known], [r["theory"] for r in known], "--", color=color, alpha=0.6,
                    label="(p-1)/(m+p-1)" if schedule == "gpipe" else "(p-1)/(v·m+p-1), v=2")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches per step (m)")
    ax.set_ylabel("idle fraction per stage (mean of the 2 ranks)")
    ax.set_title(f"Pipeline bubble: p = 2, GPT 8×256, {per_micro_batch}×64 tokens per micro-batch, CPU")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedule names")
    parser.add_argument("--micro-batches", default=",".join(map(str, MICRO_BATCHES)), help="values of m")
    parser.add_argument("--rows", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="measured steps per setting")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--plot", help="and a PNG plot here")
    args = parser.parse_args()
    schedules, micro_batches = args.schedules.split(","), [int(m) for m in args.micro_batches.split(",")]
    call = (schedules, micro_batches, args.rows, args.steps, args.warmup)
    per_rank = run_distributed(rank_main, P, call, timeout_s=3600)
    rows = []
    print(f"{'schedule':<24} {'m':>3} {'rank 0':>7} {'rank 1':>7} {'mean':>7} {'theory':>7} {'ratio':>6}")
    for first, second in zip(*per_rank, strict=True):
        if "skipped" in first:
            print(f"{first['schedule']:<24} {first['m']:>3}  skipped: {first['skipped']}")
            rows.append(first)
            continue
        mean = (first["idle"] + second["idle"]) / 2
        expected = first["theory"]
        ratio = f"{mean / expected:6.2f}" if expected else "     -"
        shown = f"{expected:7.3f}" if expected is not None else "      -"
        print(
            f"{first['schedule']:<24} {first['m']:>3} {first['idle']:7.3f} {second['idle']:7.3f} {mean:7.3f} "
            f"{shown} {ratio}"
        )
        rows.append({**first, "idle": mean, "idle_per_rank": [first["idle"], second["idle"]]})
    if args.json:
        out = {"p": P, "sequences_per_micro_batch": args.rows, "steps": args.steps, "results": rows}
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.plot:
        plot(rows, Path(args.plot), args.rows)


if __name__ == "__main__":
    main()
