"""The planner against the dry run at 8, 64 and 512 ranks: memory per rank by component for every layout
`trainmesh plan` enumerates, predicted (`trainmesh.apps.plan.rank_memory.stage_memory`) and measured on fake tensors and
a fake process group (`trainmesh.apps.plan.dryrun`, what `trainmesh check --dry-run` runs). Nothing here needs a GPU
or a cluster.

For each model and world size it takes `plan_layouts` on the `h100` preset (one layout per kind, degrees, activation
checkpointing and gradient mode, each at the micro-batch the plan picks), resolves each to the job `trainmesh run`
would run (`Candidate.job`), dry-runs one rank of each of its pipeline stages (rank 0 without a pipeline) with 2 of
its accumulation micro-steps (the first holds what every micro-step before the last holds, see dryrun.run_rank) and
compares each component. Each layout runs in a process of its own; the JSON is written after each, and a second run
with the same --json continues where the first stopped.

Models: GPT-2 124M (vocabulary 50304, context 1024, global batch 512 sequences) and a GPT-shaped 7B (32 × 4096, 32
heads, vocabulary 32000, context 4096, global batch 1024), both bf16-mixed, as in benchmarks/plan_scaling.py.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/plan_dryrun.py [--models gpt2 gpt7b] [--world-sizes 8 64 512]
        [--workers 2] [--json docs/plan_dryrun.json]
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/plan_dryrun.py --repredict docs/plan_dryrun.json
        (the saved measurements against the planner as it is now, written back to the same file)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from plan_scaling import MODELS, cluster_for
from trainmesh.apps.plan.dryrun import (
    COMPONENTS,
    TOLERANCE,
    Comparison,
    DryRun,
    RankMemory,
    compare,
    dry_run,
    dry_run_job,
)
from trainmesh.apps.plan.search import Workload, plan_layouts
from trainmesh.job.spec import load_config

MiB = 2**20
WORLD_SIZES = (8, 64, 512)


def layouts(model_key: str, world_size: int) -> list[dict[str, Any]]:
    """The layouts the plan enumerates for the model at `world_size`, as overrides `trainmesh run` takes."""
    model = next(m for m in MODELS if m.key == model_key)
    config = load_config(None, list(model.overrides), "gpt")
    work = Workload.from_config(config, model.strong_batch)
    out = []
    for est in plan_layouts(config, work, cluster_for(world_size)):
        cand = est.candidate
        out.append(
            {
                "model": model_key,
                "world_size": world_size,
                "layout": cand.name,
                "micro_batch": cand.micro_batch,
                "pp": cand.pp,
                "overrides": [*model.overrides, *cand.overrides(model.strong_batch)],
            }
        )
    return out


def figures(comparison: Comparison) -> dict[str, Any]:
    """One rank's predicted and measured MiB by component, the errors and the parts off by more than TOLERANCE."""
    return {
        "predicted_MiB": {k: round(v / MiB, 2) for k, v in comparison.predicted.items()},
        "measured_MiB": {k: round(v / MiB, 2) for k, v in comparison.measured.items()},
        "error": {k: round(comparison.error(k), 4) for k in comparison.predicted},
        "disagree": comparison.disagreements(),
    }


def combined(row: dict[str, Any], comparisons: list[Comparison]) -> dict[str, Any]:
    """The row with its ranks' figures: the most loaded rank's at the top level (and, for a pipeline, each stage's
    under "stages"), the largest error of each component over the stages and every part off on any stage."""
    each = [
        {"stage": c.rank.stage, "seconds": round(c.rank.seconds, 2), "pieces": c.rank.pieces, **figures(c)}
        for c in comparisons
    ]
    top = max(each, key=lambda s: s["measured_MiB"]["peak"])
    out = {**row, **{k: v for k, v in top.items() if k not in ("stage", "pieces")}}
    out["seconds"] = round(sum(s["seconds"] for s in each), 2)
    out["error"] = {k: max(s["error"][k] for s in each) for k in top["error"]}
    out["disagree"] = [k for k in top["error"] if any(k in s["disagree"] for s in each)]
    if len(each) > 1:
        out["stages"] = each
    return out


def measure(row: dict[str, Any]) -> dict[str, Any]:
    """Dry-run one layout, one rank of each pipeline stage, and compare it with the plan (in a process of its own)."""
    from trainmesh.job.spec import resolve

    config = load_config(None, row["overrides"], "gpt")
    job = resolve(config, row["world_size"])
    run = dry_run(job, micro_steps=2)
    comparisons = compare(run, config, cluster_for(row["world_size"]))
    return {**combined(row, comparisons), "accum_steps": job.batch.accum_steps}


def repredict(row: dict[str, Any]) -> dict[str, Any]:
    """A measured row's prediction and errors again, from the planner as it is now (the measurement does not
    depend on it)."""
    if "measured_MiB" not in row:
        return row
    from trainmesh.job.spec import resolve

    config = load_config(None, row["overrides"], "gpt")
    job = dry_run_job(resolve(config, row["world_size"]))
    ranks = []
    for stage in row.get("stages", [{**row, "stage": 0}]):
        measured = {k: int(v * MiB) for k, v in stage["measured_MiB"].items()}
        peak = measured.pop("peak")
        pieces = stage.get("pieces", job.config.parallel.pipeline.microbatches if job.layout.dims.pp > 1 else 1)
        ranks.append(RankMemory(0, stage["stage"], measured, peak, stage["seconds"], pieces))
    comparisons = compare(DryRun(job, ranks, 2), config, cluster_for(row["world_size"]))
    return {**combined({k: v for k, v in row.items() if k != "stages"}, comparisons), "seconds": row["seconds"]}


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per model and world size: layouts run, how many agree on every component, the largest error of each."""
    lines = []
    for key in dict.fromkeys(r["model"] for r in rows):
        for world in dict.fromkeys(r["world_size"] for r in rows if r["model"] == key):
            group = [r for r in rows if r["model"] == key and r["world_size"] == world]
            run = [r for r in group if "error" in r]
            agree = sum(not r["disagree"] for r in run)
            worst = {part: max((r["error"][part] for r in run), default=0.0) for part in (*COMPONENTS, "peak")}
            worst_text = ", ".join(f"{part} {err:.1%}" for part, err in worst.items())
            lines.append(f"| {key} | {world} | {len(group)} | {len(run)} | {agree} | {worst_text} |")
    return [
        f"| model | ranks | layouts | dry-run | all within {TOLERANCE:.0%} | largest error per component |",
        "|---|---|---|---|---|---|",
        *lines,
    ]


def run_one(row: dict[str, Any]) -> dict[str, Any]:
    """`measure(row)` in a process of its own (a crash, even a segfault, costs that row only)."""
    done = subprocess.run(
        [sys.executable, __file__, "--one", json.dumps(row)], capture_output=True, text=True, check=False
    )
    for line in reversed(done.stdout.splitlines() if done.returncode == 0 else []):
        if line.startswith("{"):
            try:
                result: dict[str, Any] = json.loads(line)
                return result
            except json.JSONDecodeError:
                break
    return {**row, "failed": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}


def dump(rows: list[dict[str, Any]]) -> str:
    """The table as JSON, a row a line."""
    return '{"rows": [\n' + ",\n".join(json.dumps(row, ensure_ascii=False) for row in rows) + "\n]}\n"


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    """A layout as the plan enumerated it: a row of an earlier run counts only if the plan still picks it alike."""
    return row["model"], row["world_size"], row["layout"], row["micro_batch"], tuple(row["overrides"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=[m.key for m in MODELS])
    parser.add_argument("--world-sizes", nargs="+", type=int, default=list(WORLD_SIZES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("docs/plan_dryrun.json"))
    parser.add_argument(
        "--repredict", type=Path, help="a saved table: predict its measured rows again and rewrite it; run nothing"
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a row to measure, in this process (run_one)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(json.loads(args.one))))
        return
    if args.repredict:
        saved = json.loads(args.repredict.read_text())
        rows = [repredict(row) for row in saved["rows"]]
        args.repredict.write_text(dump(rows))
        print("\n".join(summary(rows)))
        return
    todo = [row for key in args.models for world in args.world_sizes for row in layouts(key, world)]
    done = json.loads(args.json.read_text())["rows"] if args.json.exists() else []  # a run to continue
    wanted = {key(r) for r in todo}
    # kept: every row measured before (other models and world sizes too), not one that failed or was skipped
    rows = [r for r in done if not (key(r) in wanted and ("failed" in r or "skipped" in r))]
    seen = {key(r) for r in rows}
    start = time.perf_counter()
    with ThreadPoolExecutor(args.workers) as pool:
        for future in as_completed([pool.submit(run_one, r) for r in todo if key(r) not in seen]):
            row = future.result()
            rows.append(row)
            note = row.get("skipped") or row.get("failed") or (", ".join(row["disagree"]) or "agrees")
            print(f"{row['model']} {row['world_size']:4d} {row['layout']:32s} mb {row['micro_batch']:3d}: {note}")
            args.json.write_text(dump(rows))  # kept as it goes
    print(f"{time.perf_counter() - start:.0f} s")
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
