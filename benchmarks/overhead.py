"""Framework overhead: trainmesh's DDP training step vs a plain hand-written PyTorch DDP loop.

Both sides train the same GPT (trainmesh.recipes.gpt.model.GPT), on the same TokenWindows data with the
same batch shapes, with AdamW (two weight-decay groups), the same lr schedule, gradient clipping and one
logging all-reduce of the loss per step. Rounds are interleaved (trainmesh, plain, trainmesh, plain, ...)
in one torchrun job of 2 gloo ranks × 1 thread on the CPU; the first `--warmup` steps of every round are
dropped. The figure is median(trainmesh step time) / median(plain step time); target <= 1.02.

    python benchmarks/overhead.py [--steps 50 --rounds 6 --warmup 5 --size tiny --json out.json]

Extra `--section.key=value` arguments are passed to trainmesh's config (both sides read it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from launcher import launch, timed_run_overrides, typed_command
from trainmesh.config import Config
from trainmesh.core.batch import BatchSplit
from trainmesh.data.corpus import default_cache_dir
from trainmesh.job.spec import load_config, resolve
from trainmesh.metrics.sinks import METRICS_FILE, read_metrics
from trainmesh.recipes import get_recipe
from trainmesh.recipes.gpt.model import GPT, GPTConfig
from trainmesh.runtime.runtime import Runtime
from trainmesh.train import loop
from trainmesh.train.optim import lr_at

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt-tiny.toml"
TARGET = 1.02


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per side per round")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds (each: trainmesh, then plain)")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of every round")
    parser.add_argument("--size", choices=["nano", "tiny"], default="tiny", help="GPT size (model.size)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes), 1 thread each")
    parser.add_argument("--config", default=str(CONFIG), help="trainmesh TOML config")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()), help="tokenised-corpus cache")
    parser.add_argument("--json", help="also write the results as JSON here")
    parser.add_argument("--verbose", action="store_true", help="keep trainmesh's INFO logging")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised arguments {bad}; config overrides look like --section.key=value")
    if not 0 <= args.warmup < args.steps - 1 or args.rounds < 1:
        parser.error("need --rounds >= 1 and 0 <= --warmup < --steps - 1")
    return args, rest


def trainmesh_round(args: argparse.Namespace, overrides: list[str], rt: Runtime, out: Path, r: int) -> dict[str, Any]:
    config = load_config(args.config, [*overrides, f"--run.out_dir={out}", f"--run.id=trainmesh-{r}"], "gpt")
    run_dir = out / config.run.id
    loop.train(config, resolve(config, rt.world_size).batch, get_recipe("gpt"), rt, run_dir)
    if not rt.is_main_process:
        return {}
    records = sorted((x for x in read_metrics(run_dir / METRICS_FILE) if x["kind"] == "train"), key=lambda x: x["step"])
    assert [x["step"] for x in records] == list(range(1, args.steps + 1)), "expected one train record per step"
    # step_time_ms is wall time between metric records: with log_every=1, one whole step including
    # data loading and the step's own logging.
    return {"ms": [x["step_time_ms"] for x in records[args.warmup :]], "loss": records[-1]["loss"]}


def batches(loader: DataLoader[Any], sampler: DistributedSampler[Any]) -> Iterator[Any]:
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


def plain_round(config: Config, data: Dataset[Any], plan: BatchSplit, steps: int) -> dict[str, Any]:
    """build-nanogpt style: DDP, mean cross-entropy / accum, no_sync, clip, AdamW, all-reduce the loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.run.seed)
    assert isinstance(config.model, GPTConfig)
    model = GPT(config.model)
    o = config.parallel.ddp  # the same DDP knobs as trainmesh, so only the loop differs (GPT has no buffers)
    ddp = DistributedDataParallel(
        model,
        bucket_cap_mb=o.bucket_cap_mb,
        static_graph=o.static_graph,
        find_unused_parameters=o.find_unused_parameters,
        gradient_as_bucket_view=o.gradient_as_bucket_view,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    opt = config.optim
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": opt.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.beta1, opt.beta2), eps=opt.eps)
    sampler = DistributedSampler(data, world, rank, shuffle=True, seed=config.run.seed, drop_last=True)
    loader = DataLoader(data, batch_size=plan.micro_batch, sampler=sampler, drop_last=True)
    data_iter = batches(loader, sampler)
    times: list[float] = []
    loss_value = norm_value = float("nan")
    dist.barrier()
    for step in range(steps):
        t0 = time.perf_counter()
        lr = lr_at(step, opt, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_accum = torch.zeros(())
        for micro in range(plan.accum_steps):
            x, y = next(data_iter)
            last = micro == plan.accum_steps - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                logits = ddp(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / plan.accum_steps
                loss_accum += loss.detach()
                loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), config.train.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss_accum, op=dist.ReduceOp.SUM)  # gloo has no AVG
        loss_value, norm_value = loss_accum.item() / world, float(norm)  # what build-nanogpt prints
        times.append(1000 * (time.perf_counter() - t0))
    return {"ms": times, "loss": loss_value, "grad_norm": norm_value}


def stats(ms: list[float]) -> dict[str, float]:
    p10, p25, p50, p75, p90 = np.percentile(ms, [10, 25, 50, 75, 90]).tolist()
    return {"median_ms": p50, "p10_ms": p10, "p25_ms": p25, "p75_ms": p75, "p90_ms": p90, "n": len(ms)}


def report(args: argparse.Namespace, plan: BatchSplit, tm: list[dict[str, Any]], pl: list[dict[str, Any]]) -> None:
    sides = {
        "trainmesh": stats([t for r in tm for t in r["ms"]]),
        "plain": stats([t for r in pl for t in r["ms"]]),
    }
    ratio = sides["trainmesh"]["median_ms"] / sides["plain"]["median_ms"]
    verdict = "PASS" if ratio <= TARGET else "ABOVE TARGET"
    command = typed_command()
    print("\n== framework overhead: trainmesh DDP step vs plain PyTorch DDP loop ==")
    print(f"command: {command}")
    print(f"torch {torch.__version__}; {dist.get_world_size()} gloo ranks × {torch.get_num_threads()} thread, CPU")
    print(f"model size={args.size}; {plan.describe()}")
    print(f"{args.rounds} rounds × {args.steps} steps per side, first {args.warmup} dropped per round")
    for name in ("trainmesh", "plain"):
        s = sides[name]
        print(
            f"  {name:<15} median {s['median_ms']:8.2f} ms   p10-p90 {s['p10_ms']:.2f}-{s['p90_ms']:.2f}   "
            f"IQR {s['p25_ms']:.2f}-{s['p75_ms']:.2f}   n={s['n']}"
        )
    for i, (a, b) in enumerate(zip(tm, pl, strict=True)):
        ma, mb = float(np.median(a["ms"])), float(np.median(b["ms"]))
        print(
            f"  round {i}: trainmesh {ma:.2f} ms, plain {mb:.2f} ms, ratio {ma / mb:.3f}; "
            f"final loss {a['loss']:.4f} / {b['loss']:.4f}"
        )
    print(f"ratio median(trainmesh)/median(plain) = {ratio:.4f}   target <= {TARGET}   {verdict}")
    if args.json:
        result = {
            "command": command,
            "torch": torch.__version__,
            "world_size": dist.get_world_size(),
            "size": args.size,
            "steps": args.steps,
            "rounds": args.rounds,
            "warmup": args.warmup,
            "plan": plan.describe(),
            **sides,
            "ratio": ratio,
            "target": TARGET,
            "verdict": verdict,
        }
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


def rank_main(args: argparse.Namespace, extra: list[str]) -> int:
    torch.set_num_threads(1)
    overrides = [
        *timed_run_overrides(args.size, args.steps, args.cache_dir),
        *extra,
    ]
    base = load_config(args.config, overrides, "gpt")
    job = resolve(base, int(os.environ["WORLD_SIZE"]))
    plan = job.batch
    rt = job.runtime()  # one process group for every round of both sides
    if not args.verbose:
        rt.log.setLevel("WARNING")
    out = Path(rt.broadcast_object(tempfile.mkdtemp(prefix="overhead-") if rt.is_main_process else ""))
    try:
        recipe = get_recipe("gpt")
        train_set, _ = recipe.prepare(base, rt)
        tm: list[dict[str, Any]] = []
        pl: list[dict[str, Any]] = []
        for r in range(args.rounds):
            tm.append(trainmesh_round(args, overrides, rt, out, r))
            pl.append(plain_round(base, train_set, plan, args.steps))
            pl[-1]["ms"] = pl[-1]["ms"][args.warmup :]
        if rt.is_main_process:
            report(args, plan, tm, pl)
        rt.barrier()
    finally:
        if rt.is_main_process:
            shutil.rmtree(out, ignore_errors=True)
    rt.teardown(success=True)
    return 0


def main() -> int:
    args, extra = parse_args(sys.argv[1:])
    if "RANK" not in os.environ:
        return launch(__file__, sys.argv[1:], args.nproc)
    return rank_main(args, extra)


if __name__ == "__main__":
    sys.exit(main())
