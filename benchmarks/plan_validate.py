"""`trainmesh plan`'s predictions against measurements on this machine: memory per rank by component, and step time
after calibration.

1. Calibrate (`trainmesh.apps.plan.calibrate.calibrate`, what `trainmesh plan --calibrate` runs) with the measured
   layouts' model and micro-batch, unless `--calibration` names a saved one.
2. Measure every layout (benchmarks/plan_measure.py: the real trainmesh set-up and loop step on gloo processes,
   per rank: params, grads, optimizer state, the live peak of saved activations, FSDP's gathered parameters, the
   median step time), or read a saved measurement (`--measured`).
3. Predict each rank from the same resolved job (`Candidate.from_job`, `rank_memory.stage_memory` for the rank's
   pipeline stage, `estimate.step_time`) and compare. Memory is compared for every layout (4 and 8 processes
   are oversubscribed on a 2-core machine, which changes no byte); step time only where every process has a core
   of its own (the calibration's devices per node).

    OMP_NUM_THREADS=1 python benchmarks/plan_validate.py [--measured docs/plan_validation.json]
        [--calibration F.json] [--json docs/plan_validation.json] [--plot docs/plan_validation.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from plan_measure import CASES, case_overrides, measure_layout
from trainmesh.apps.plan.calibrate import calibrate, reference_step_seconds
from trainmesh.apps.plan.cluster import Cluster, load_calibration
from trainmesh.apps.plan.estimate import step_time
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.rank_memory import stage_memory
from trainmesh.job.spec import load_config, resolve
from trainmesh.metrics.sinks import write_figure

MiB = 2**20
COMPONENTS = {
    "params": "params",
    "grads": "grads",
    "optimizer": "optimizer",
    "activations": "act_peak",
    "gathered": "gathered_params",
}
"""Predicted component -> the measurement's key (plan_measure.py)."""


def predict(layout: dict[str, Any], rank: dict[str, Any], cluster: Cluster) -> dict[str, Any]:
    """Prediction for one measured rank: memory by component (offloaded state counted where it lives: on a CPU the
    host is the device) and, for the rank's stage, the step time by phase."""
    job = resolve(load_config(None, layout["overrides"], "gpt"), layout["world_size"])
    cand, spec = Candidate.from_job(job), ModelSpec(job.config.model)  # type: ignore[arg-type]
    precision = PrecisionBytes(job.config.train.precision)
    stage = rank["coords"]["pp"]
    parts, host = stage_memory(spec, cand, precision, cluster, job.batch.accum_steps, stage)
    memory = {k: parts[k] + host.get(k, 0.0) for k in COMPONENTS}
    time = step_time(spec, cand, precision, cluster, job.batch.accum_steps, job.config.train.tf32)
    return {"memory": memory, "step_s": sum(time.values()), "time": time}


def measure_with_reference(steps: int) -> list[dict[str, Any]]:
    """Every layout, each just after timing the machine's reference step (`reference_step_seconds`: what the
    calibration times), so that a drift of the machine's speed between the layouts and the calibration shows."""
    single = load_config(None, case_overrides(CASES[0], (), 4), "gpt")
    measured = []
    for case in CASES:
        reference = reference_step_seconds(single)
        result = measure_layout(case, steps=steps, warmup=3)
        print(f"  {case.name:<20} {case.world_size} ranks: {result['status']} (reference {reference * 1e3:.0f} ms)")
        measured.append({**result, "reference_s": reference})
    return measured


def compare(measured: list[dict[str, Any]], cluster: Cluster) -> list[dict[str, Any]]:
    """One row per measured rank. With reference timings, the prediction is also scaled by the machine's speed at
    the layout's measurement against its speed when calibrated (the reference step's predicted time, which the
    calibration reproduces): `predicted_step_s_at_measurement`."""
    single = next((m for m in measured if m["name"] == "single" and m["status"] == "ok"), None)
    calibrated_reference = predict(single, single["ranks"][0], cluster)["step_s"] if single else 1.0
    rows = []
    for layout in measured:
        if layout["status"] != "ok":
            continue
        timed = layout["world_size"] <= cluster.devices_per_node
        compared = list(COMPONENTS)  # what FSDP holds within a pipeline's schedule is in the temporaries
        for rank in layout["ranks"]:
            pred = predict(layout, rank, cluster)
            drift = layout.get("reference_s", calibrated_reference) / calibrated_reference if single else 1.0
            rows.append(
                {
                    "layout": layout["name"],
                    "world_size": layout["world_size"],
                    "rank": rank["rank"],
                    "stage": rank["coords"]["pp"],
                    "measured": {k: rank[key] for k, key in COMPONENTS.items()},
                    "predicted": pred["memory"],
                    "compared": compared,
                    "timed": timed,
                    "measured_step_s": rank["step_ms"] / 1000,
                    "predicted_step_s": pred["step_s"],
                    "machine_drift": drift,
                    "predicted_step_s_at_measurement": pred["step_s"] * drift,
                    "predicted_time": pred["time"],
                }
            )
    return rows


def error(predicted: float, measured: float) -> float:
    return 0.0 if predicted == measured else (predicted - measured) / measured if measured else float("inf")


def print_rows(rows: list[dict[str, Any]]) -> None:
    print(f"{'layout':<18} {'rank':>4} {'st':>2} | " + " ".join(f"{k[:6]:>15}" for k in COMPONENTS) + " | step ms")
    for r in rows:
        cells = []
        for k in COMPONENTS:
            m, p = r["measured"][k], r["predicted"][k]
            mark = "" if m == p else "*"
            cells.append(f"{m / MiB:6.2f}/{p / MiB:6.2f}{mark}")
        if r["timed"]:
            step = f"{r['measured_step_s'] * 1e3:5.0f}/{r['predicted_step_s'] * 1e3:5.0f} "
            step += f"{error(r['predicted_step_s'], r['measured_step_s']):+6.1%} (machine ×{r['machine_drift']:.3f}: "
            step += f"{error(r['predicted_step_s_at_measurement'], r['measured_step_s']):+6.1%})"
        else:
            step = "(oversubscribed: memory only)"
        print(
            f"{r['layout']:<18} {r['rank']:>4} {r['stage']:>2} | " + " ".join(f"{c:>15}" for c in cells) + f" | {step}"
        )
    print("\nMiB measured/predicted (* where they differ); step ms measured/predicted and the prediction's error")


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    memory = [abs(error(r["predicted"][k], r["measured"][k])) for r in rows for k in r["compared"] if r["measured"][k]]
    timed = [abs(error(r["predicted_step_s"], r["measured_step_s"])) for r in rows if r["timed"]]
    steady = [abs(error(r["predicted_step_s_at_measurement"], r["measured_step_s"])) for r in rows if r["timed"]]
    return {
        "step_at_measurement_max_abs_error": max(steady),
        "step_at_measurement_mean_abs_error": sum(steady) / len(steady),
        "step_at_measurement_within_15pct": sum(e <= 0.15 for e in steady) / len(steady),
        "memory_max_abs_error": max(memory),
        "memory_within_5pct": sum(e <= 0.05 for e in memory) / len(memory),
        "step_max_abs_error": max(timed),
        "step_mean_abs_error": sum(timed) / len(timed),
        "step_within_15pct": sum(e <= 0.15 for e in timed) / len(timed),
    }


def plot(rows: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, step) = plt.subplots(1, 2, figsize=(14, 6.2))
    markers = dict(zip(COMPONENTS, "osD^v", strict=True))
    for k in COMPONENTS:
        pts = [
            (r["measured"][k] / MiB, r["predicted"][k] / MiB) for r in rows if r["measured"][k] and k in r["compared"]
        ]
        mem.scatter(*zip(*pts, strict=True), marker=markers[k], label=k, alpha=0.7)
    lo, hi = 1.0, max(max(r["measured"][k] for k in COMPONENTS) for r in rows) / MiB * 1.3
    for ax, (a, b), band in ((mem, (lo, hi), 0.05),):
        ax.plot([a, b], [a, b], color="black", linewidth=1)
        ax.fill_between([a, b], [a * (1 - band), b * (1 - band)], [a * (1 + band), b * (1 + band)], alpha=0.15)
    mem.set(xscale="log", yscale="log", xlabel="measured MiB per rank", ylabel="predicted MiB per rank")
    mem.set_title("memory by component, every layout and rank (band: ±5%)", fontsize=10)
    mem.legend(fontsize=8)
    timed = {}
    for r in rows:  # one point per layout and stage: the ranks of a stage run alike
        if r["timed"]:
            timed.setdefault((r["layout"], r["stage"]), r)
    xs = [r["measured_step_s"] * 1e3 for r in timed.values()]
    ys = [r["predicted_step_s"] * 1e3 for r in timed.values()]
    step.scatter(xs, ys, color="#c44e52")
    for r, x, y in zip(timed.values(), xs, ys, strict=True):
        label = r["layout"] + (f" (stage {r['stage']})" if r["stage"] or "pp" in r["layout"] else "")
        step.annotate(label, (x, y), fontsize=7, xytext=(4, 2), textcoords="offset points")
    a, b = min(xs + ys) * 0.8, max(xs + ys) * 1.2
    step.plot([a, b], [a, b], color="black", linewidth=1)
    step.fill_between([a, b], [a * 0.85, b * 0.85], [a * 1.15, b * 1.15], alpha=0.15)
    step.set(xlabel="measured ms per step (median)", ylabel="predicted ms per step")
    step.set_title("step time after calibration, 1 and 2 processes (band: ±15%)", fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    write_figure(fig, Path(path))
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", help="a saved plan_measure.py or plan_validate.py JSON (default: measure now)")
    parser.add_argument("--calibration", help="a saved calibration (default: calibrate now, with the same model)")
    parser.add_argument("--steps", type=int, default=7, help="timed steps per layout when measuring")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    started = time.perf_counter()
    if args.measured:
        measured = json.loads(Path(args.measured).read_text())["layouts"]
    else:
        measured = measure_with_reference(args.steps)
    single = next(m for m in measured if m["name"] == "single")
    if args.calibration:
        cluster = load_calibration(Path(args.calibration))
    else:
        with tempfile.TemporaryDirectory() as folder:
            cluster = calibrate(load_config(None, single["overrides"], "gpt"), Path(folder) / "calibration.json")
    rows = compare(measured, cluster)
    print_rows(rows)
    figures = summary(rows)
    print("\n" + "\n".join(f"{k}: {v:.4f}" for k, v in figures.items()))
    print(f"total {time.perf_counter() - started:.0f} s")
    model, micro = single["config"]["model"], single["config"]["train"]["micro_batch"]
    title = (
        f"trainmesh plan vs measured: GPT {model['size']} ({single['n_params'] / 1e6:.1f}M params, vocab "
        f"{model['vocab_size']}, {model['block_size']} tokens), micro-batch {micro}, fp32, CPU/gloo "
        f"({cluster.calibrated})"
    )
    if args.plot:
        plot(rows, args.plot, title)
    if args.json:
        out = {
            "command": " ".join(sys.argv),
            "calibration": asdict(cluster),
            "summary": figures,
            "rows": rows,
            "layouts": measured,  # the measurements themselves: --measured reads them back
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
