"""`trainmesh plan` calibrated on this GPU, then its predictions against measurements of the single-GPU layouts at the
GPT-2 shape: step time (target: within 15%) and memory per component and in all (target: within 5%).

1. Calibrate (`trainmesh.apps.plan.calibrate.calibrate`, what `trainmesh plan --calibrate` runs) with GPT-2 124M in
   bf16-mixed at micro-batch 16, unless `--calibration` names a saved one.
2. Measure each layout on one device (benchmarks/plan_measure.py: the real set-up and loop step, memory by
   component from the same probes; here also the device's own peak, `torch.cuda.max_memory_allocated`, of the
   measured step): one GPU at micro-batches 8, 16 and 32, with activation checkpointing at 16 and 32, and FSDP with
   CPU offload at 16.
3. Predict each (benchmarks/plan_validate.py's comparison) and write every figure.

Without CUDA it runs a nano model on the CPU against the h100 preset for one micro-batch, so CI keeps it working
(the figures then mean nothing).

    python benchmarks/plan_gpu.py [--calibration F.json] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from plan_measure import Case, measure_layout
from plan_validate import compare, error
from trainmesh.apps.plan.calibrate import calibrate
from trainmesh.apps.plan.cluster import PRESETS, Cluster, load_calibration
from trainmesh.apps.plan.estimate import estimate_layout
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.job.spec import load_config, resolve

GPT2 = ("--model.size=gpt2", "--model.block_size=1024", "--model.vocab_size=50304", "--train.precision=bf16-mixed")
NANO = ("--model.size=nano", "--model.block_size=16", "--model.vocab_size=256", "--train.precision=32-true")
CUDA = ("--dist.device=cuda", "--dist.backend=nccl", "--train.compile=false")
OFFLOAD = ("--parallel.strategy=fsdp", "--parallel.fsdp.cpu_offload=true")
AC = ("--parallel.activation_checkpointing=1",)
LAYOUTS: tuple[tuple[str, int, tuple[str, ...]], ...] = (
    ("single", 8, ()),
    ("single", 16, ()),
    ("single", 32, ()),
    ("single +AC", 16, AC),
    ("single +AC", 32, AC),
    ("fsdp offload", 16, OFFLOAD),
)
"""(name, micro-batch, overrides): the single-GPU layouts the planner is validated on."""


def measure(name: str, micro: int, overrides: tuple[str, ...], common: tuple[str, ...]) -> dict[str, Any]:
    case = Case(f"{name} mb{micro}", 1, overrides)
    return measure_layout(case, (*common, f"--train.micro_batch={micro}"), micro_batch=micro, warmup=3, steps=10)


def total_rows(measured: list[dict[str, Any]], cluster: Cluster) -> list[dict[str, Any]]:
    """The device's peak of each layout's measured step against the plan's total (its parts and the cluster's
    fixed overhead, less what CPU offload keeps in host memory)."""
    rows = []
    for layout in measured:
        if layout["status"] != "ok" or "device_peak" not in layout["ranks"][0]:
            continue
        job = resolve(load_config(None, layout["overrides"], "gpt"), 1)
        est = estimate_layout(
            ModelSpec(job.config.model),  # type: ignore[arg-type]
            Candidate.from_job(job),
            PrecisionBytes(job.config.train.precision),
            cluster,
            job.batch.accum_steps,
            job.config.train.tf32,
        )
        predicted = sum(v for k, v in est.memory.items() if k != "overhead")
        measured_peak = layout["ranks"][0]["device_peak"]
        rows.append({"layout": layout["name"], "measured": measured_peak, "predicted": predicted})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibration", help="a saved calibration (default: calibrate now)")
    parser.add_argument("--json")
    args = parser.parse_args()
    started = time.perf_counter()
    gpu = torch.cuda.is_available()
    common = (*GPT2, *CUDA) if gpu else NANO
    layouts = LAYOUTS if gpu else LAYOUTS[:1]
    if args.calibration:
        cluster = load_calibration(Path(args.calibration))
    elif gpu:
        with tempfile.TemporaryDirectory() as folder:
            config = load_config(None, [*GPT2, "--train.micro_batch=16"], "gpt")
            cluster = calibrate(config, Path(folder) / "calibration.json")
    else:
        cluster = PRESETS["h100"]
    measured = []
    for name, micro, overrides in layouts:
        result = measure(name, micro, overrides, common)
        print(f"  {result['name']:<20} {result['status']} ({result.get('wall_s', 0):.0f} s)", flush=True)
        measured.append(result)
    rows, totals = compare(measured, cluster), total_rows(measured, cluster)
    for r in rows:
        parts = " ".join(f"{k} {r['measured'][k] / 2**20:.0f}/{r['predicted'][k] / 2**20:.0f}" for k in r["compared"])
        step = f"{r['measured_step_s'] * 1e3:.1f}/{r['predicted_step_s'] * 1e3:.1f} ms"
        print(f"{r['layout']:<20} step {step} ({error(r['predicted_step_s'], r['measured_step_s']):+.1%}) | {parts}")
    for t in totals:
        print(
            f"{t['layout']:<20} device peak {t['measured'] / 2**30:.2f} GiB, plan {t['predicted'] / 2**30:.2f} GiB "
            f"({error(t['predicted'], t['measured']):+.1%})"
        )
    memory = [abs(error(r["predicted"][k], r["measured"][k])) for r in rows for k in r["compared"] if r["measured"][k]]
    steps = [abs(error(r["predicted_step_s"], r["measured_step_s"])) for r in rows]
    summary = {  # NaN where no layout ran (each layout's error is in the JSON)
        "step_within_15pct": sum(e <= 0.15 for e in steps) / len(steps) if steps else math.nan,
        "step_max_abs_error": max(steps, default=math.nan),
        "memory_within_5pct": sum(e <= 0.05 for e in memory) / len(memory) if memory else math.nan,
        "memory_max_abs_error": max(memory, default=math.nan),
        "peak_max_abs_error": max((abs(error(t["predicted"], t["measured"])) for t in totals), default=math.nan),
    }
    print("\n".join(f"{k}: {v:.4f}" for k, v in summary.items()) + f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        out = {
            "command": " ".join(sys.argv),
            "device": torch.cuda.get_device_name() if gpu else "cpu",
            "calibration": cluster.calibrated,
            "summary": summary,
            "rows": rows,
            "totals": totals,
            "layouts": measured,
        }
        Path(args.json).write_text(json.dumps(out, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
