"""Gradient communication under DDP: step time and exposed communication for each bucket size and comm hook.

One torchrun job of `--nproc` gloo ranks × 1 thread on 127.0.0.1 trains the GPT recipe (configs/gpt-tiny.toml)
with trainmesh's own loop, once per setting: parallel.ddp.bucket_cap_mb × parallel.ddp.comm_hook. Settings are
interleaved over `--rounds` rounds (a, b, c, ..., a, b, c, ...); the first `--warmup` steps of every run are
dropped. Per setting: the median step time and the median of the breakdown's phases, among them `comm`, the
exposed communication (the wait, after the last gradient bucket is handed to the network, for the all-reduce
to finish). PowerSGD compresses from its 3rd step here (parallel.ddp.powersgd_start_iter=2), at rank 1; on
gloo it finishes each bucket's exchange inside backward (docs/parallelism.md), so only its last bucket's shows
as exposed communication: compare its step time.
Writes comm.json, comm.md (the table) and comm.png (step time split into exposed communication and the rest).

    python benchmarks/comm.py [--buckets 0.25,1,25 --hooks none,fp16,powersgd --steps 30 --rounds 2 --out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from launcher import launch, timed_run_overrides, typed_command
from trainmesh.config.schema import COMM_HOOKS
from trainmesh.data.corpus import default_cache_dir
from trainmesh.job.spec import load_config, resolve
from trainmesh.metrics.breakdown import PHASES
from trainmesh.metrics.sinks import METRICS_FILE, read_metrics
from trainmesh.recipes import get_recipe
from trainmesh.train import loop

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "gpt-tiny.toml"
SCRATCH_ENV = "TRAINMESH_COMM_SCRATCH"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", default="0.25,1,25", help="bucket sizes in MiB (parallel.ddp.bucket_cap_mb)")
    parser.add_argument("--hooks", default="none,fp16,powersgd", help="comm hooks (parallel.ddp.comm_hook)")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps dropped at the start of every run")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over all settings")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (processes), 1 thread each")
    parser.add_argument("--size", default="tiny", help="GPT size (model.size)")
    parser.add_argument("--config", default=str(CONFIG), help="trainmesh TOML config")
    parser.add_argument("--cache-dir", default=str(default_cache_dir()), help="tokenised-corpus cache")
    parser.add_argument("--out", default="runs/bench-comm", help="folder for comm.json, comm.md, comm.png")
    args = parser.parse_args(argv)
    try:
        args.bucket_list = [float(b) for b in args.buckets.split(",")]
    except ValueError:
        parser.error(f"--buckets={args.buckets!r}: comma-separated numbers of MiB, e.g. 0.25,1,25")
    args.hook_list = args.hooks.split(",")
    unknown = [h for h in args.hook_list if h not in COMM_HOOKS or h == "bf16"]
    if unknown:
        parser.error(f"--hooks: {unknown} not among none, fp16, powersgd (bf16 needs NCCL)")
    if min(args.bucket_list) <= 0 or args.rounds < 1 or not 0 <= args.warmup < args.steps:
        parser.error("need bucket sizes > 0, --rounds >= 1 and 0 <= --warmup < --steps")
    return args


def run_setting(args: argparse.Namespace, bucket: float, hook: str, out: Path, name: str) -> dict[str, Any]:
    """Train one setting in the running process group; rank 0 returns its records after warm-up."""
    overrides = [
        *timed_run_overrides(args.size, args.steps, args.cache_dir),
        "--parallel.strategy=ddp",
        f"--parallel.ddp.bucket_cap_mb={bucket}",
        f"--parallel.ddp.comm_hook={hook}",
        "--parallel.ddp.powersgd_start_iter=2",
        f"--run.out_dir={out}",
        f"--run.id={name}",
    ]
    config = load_config(args.config, overrides, "gpt")
    job = resolve(config, int(os.environ["WORLD_SIZE"]))
    runtime = job.runtime()  # adopts the job's process group, with this setting's DDP options
    runtime.log.setLevel("WARNING")
    loop.train(job.config, job.batch, get_recipe("gpt"), runtime, out / name)
    if not runtime.is_main_process:
        return {}
    records = [x for x in read_metrics(out / name / METRICS_FILE) if x["kind"] == "train"]
    return {"records": sorted(records, key=lambda x: x["step"])[args.warmup :], "tokens": job.batch.tokens_per_step}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    records = [r for run in runs for r in run["records"]]
    summary = {"step_ms": float(np.median([r["step_time_ms"] for r in records])), "steps": len(records)}
    summary |= {f"{p}_ms": float(np.median([r[f"time_{p}_ms"] for r in records])) for p in PHASES}
    summary["tokens_per_s"] = runs[0]["tokens"] / summary["step_ms"] * 1000
    summary["loss"] = runs[-1]["records"][-1]["loss"]
    return summary


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| bucket MiB | comm_hook | step (median) | exposed comm | backward | forward | optimizer | tokens/s | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['bucket_mb']:g} | {r['hook']} | {r['step_ms']:.1f} ms | {r['comm_ms']:.2f} ms | "
            f"{r['backward_ms']:.1f} ms | {r['forward_ms']:.1f} ms | {r['optimizer_ms']:.1f} ms | "
            f"{r['tokens_per_s']:,.0f} | {r['loss']:.3f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['hook']}\n{r['bucket_mb']:g} MiB" for r in results]
    comm = np.array([r["comm_ms"] for r in results])
    rest = np.array([r["step_ms"] for r in results]) - comm
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(results)), 4))
    ax.bar(labels, rest, label="rest of the step", color="#9bb7d4")
    ax.bar(labels, comm, bottom=rest, label="exposed communication", color="#d95f02")
    ax.set_ylabel("median step time (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(loc="lower right")
    ax.tick_params(axis="x", labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def rank_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    settings = [(b, h) for h in args.hook_list for b in args.bucket_list]
    runs: dict[tuple[float, str], list[dict[str, Any]]] = {s: [] for s in settings}
    shared = Path(os.environ[SCRATCH_ENV])
    for r in range(args.rounds):
        for i, (bucket, hook) in enumerate(settings):
            run = run_setting(args, bucket, hook, shared, f"r{r}-s{i}")
            if run:
                runs[(bucket, hook)].append(run)
    if os.environ["RANK"] != "0":
        return 0
    results = [{"bucket_mb": b, "hook": h, **summarise(runs[(b, h)])} for b, h in settings]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ranks = os.environ["WORLD_SIZE"]
    title = f"GPT {args.size}, {ranks} gloo ranks × 1 thread on one CPU machine, DDP ({args.rounds} rounds)"
    meta = {"command": typed_command(), "torch": torch.__version__, "cores": os.cpu_count(), "title": title}
    (out / "comm.json").write_text(json.dumps({**meta, "results": results}, indent=1))
    (out / "comm.md").write_text(f"{title}\n\n{table(results)}\n")
    plot(results, out / "comm.png", title)
    print(f"\n{title}\n\n{table(results)}\n\nwritten: {out}/comm.json, comm.md, comm.png")
    return 0


def main() -> int:
    args = parse_args(sys.argv[1:])
    if "RANK" not in os.environ:
        with tempfile.TemporaryDirectory(prefix="comm-") as scratch:  # the runs' folders, shared by the ranks
            os.environ[SCRATCH_ENV] = scratch
            return launch(__file__, sys.argv[1:], args.nproc)
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
