"""A bench's figures: each point's medians from its metrics.jsonl, speedup and efficiency against the smallest count of
the same mode, written as bench.json, bench.md and scaling.png.

Details: docs/internals.md#appsbenchreportpy
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainmesh.apps.bench.load import LOAD_RULES, PointLoad
from trainmesh.core.files import write_atomically
from trainmesh.metrics.breakdown import PHASES
from trainmesh.metrics.sinks import write_figure

BENCH_JSON = "bench.json"
BENCH_MD = "bench.md"
SCALING_PNG = "scaling.png"
SPEEDUP_DEFINITION = (
    "speedup: weak = throughput(n) / throughput(base); strong = step time(base) / step time(n). "
    "ideal = n / base processes; efficiency = speedup / ideal"
)


@dataclass(frozen=True)
class Measured:
    """One point's figures over its timed steps (those after the warm-up)."""

    steps: int
    step_ms: float
    """Median wall time of a step (metrics.jsonl's step_time_ms, one record per step)."""
    step_ms_p10: float
    step_ms_p90: float
    throughput: float
    """Global batch (tokens or samples) / median step time, per second."""
    phases_ms: dict[str, float]
    """Median ms per step of each phase of rank 0's breakdown (metrics.breakdown.PHASES)."""


def measure(records: list[dict[str, Any]], warmup: int, steps: int, units_per_step: float) -> Measured:
    """The figures of a point from its metrics.jsonl records. Raises ValueError when a timed step has no record."""
    train = {int(r["step"]): r for r in records if r.get("kind") == "train"}
    timed = [train.get(s) for s in range(warmup + 1, warmup + steps + 1)]
    missing = [warmup + 1 + i for i, r in enumerate(timed) if r is None]
    if missing:
        raise ValueError(f"no metrics record for timed step(s) {missing[:5]} (one per step was expected)")
    ms = [float(r["step_time_ms"]) for r in timed if r is not None]
    deciles = statistics.quantiles(ms, n=10, method="inclusive") if len(ms) > 1 else [ms[0]] * 9
    median = statistics.median(ms)
    phases = {p: statistics.median(float(r.get(f"time_{p}_ms", 0.0)) for r in timed if r is not None) for p in PHASES}
    return Measured(len(ms), median, deciles[0], deciles[-1], units_per_step * 1000 / median, phases)


@dataclass
class Row:
    """A line of the table: a point, how its run ended and, when it ran, its figures against the base."""

    mode: str
    processes: int
    """World size (processes over all nodes)."""
    global_batch: int
    micro_batch: int
    accum_steps: int
    units_per_step: int
    """Tokens (token recipes) or samples per optimizer step."""
    dp_ranks: int
    """Data-parallel ranks (the processes, unless pipeline or tensor parallelism groups them)."""
    run_dir: str
    exit_code: int | None = None
    """The point's launch exit code; None: not run (the bench stopped before it)."""
    error: str = ""
    """Why it has no figures, when it has none."""
    measured: Measured | None = None
    speedup: float | None = None
    ideal: float | None = None
    efficiency: float | None = None
    load: PointLoad | None = None
    """How busy this node was around the point's run (bench/load.py); None: not run."""


def speedup_of(mode: str, base: Measured, point: Measured) -> float:
    if mode == "weak":
        return point.throughput / base.throughput
    return base.step_ms / point.step_ms


def add_scaling(rows: list[Row]) -> None:
    """Fill in speedup, ideal and efficiency of every measured row, against its mode's smallest count."""
    for mode in dict.fromkeys(r.mode for r in rows):
        in_mode = [r for r in rows if r.mode == mode]
        base = min(in_mode, key=lambda r: r.processes)
        for row in in_mode:
            if base.measured is None or row.measured is None:
                continue
            row.speedup = speedup_of(mode, base.measured, row.measured)
            # Weak scaling grows the batch with the data-parallel ranks; strong scaling gives the same work more
            # processes. Without pipeline or tensor parallelism the two ratios are the same.
            row.ideal = row.dp_ranks / base.dp_ranks if mode == "weak" else row.processes / base.processes
            row.efficiency = row.speedup / row.ideal


def markdown_table(rows: list[Row], unit: str) -> str:
    """The Markdown table of bench.md (and of the log)."""
    phases = " | ".join(f"{p} ms" for p in PHASES)
    b = min((r.processes for r in rows), default=1)  # the base count (every mode runs the same counts)
    definition = {"weak": f"weak: {unit}/s(n) / {unit}/s({b})", "strong": f"strong: step ms({b}) / step ms(n)"}
    speedup = f"speedup ({'; '.join(definition[m] for m in dict.fromkeys(r.mode for r in rows))})"
    efficiency = "efficiency (speedup / n)" if b == 1 else f"efficiency (speedup / (n/{b}))"
    head = ["processes", "mode", "global batch", "step ms (p10–p90)", f"{unit}/s", speedup, efficiency]
    lines = [
        "| " + " | ".join(head) + f" | {phases} |",
        "|" + "---|" * (7 + len(PHASES)),
    ]
    for r in rows:
        m = r.measured
        if m is None:
            ended = "not run" if r.exit_code is None else f"failed (exit code {r.exit_code})"
            lines.append(f"| {r.processes} | {r.mode} | {r.global_batch} | {ended} |" + " |" * (3 + len(PHASES)))
            continue
        cells = [
            str(r.processes),
            r.mode,
            str(r.global_batch),
            f"{m.step_ms:.1f} ({m.step_ms_p10:.1f}–{m.step_ms_p90:.1f})",
            f"{m.throughput:,.0f}",
            _fmt(r.speedup, "×"),
            _fmt(r.efficiency, ""),
            *(f"{m.phases_ms[p]:.1f}" for p in PHASES),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: float | None, suffix: str) -> str:
    return "–" if value is None else f"{value:.2f}{suffix}"


def load_table(rows: list[Row]) -> str:
    """The Markdown table of how busy the node was around each point (bench.md)."""
    lines = [
        "| processes | mode | load before | load after | busy cores before | steal before | steal during |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.load is None:
            lines.append(f"| {r.processes} | {r.mode} |" + " |" * 5)
            continue
        x = r.load
        cells = [f"{x.load_before:.2f}", f"{x.load_after:.2f}", f"{x.busy_cores_before:.1f}"]
        cells += [f"{x.steal_before:.1%}", f"{x.steal:.1%}"]
        lines.append(f"| {r.processes} | {r.mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_warnings(rows: list[Row]) -> list[str]:
    """One line per reason a point's figures are doubtful (a run measured in both modes is named once)."""
    runs: dict[str, list[Row]] = {}
    for r in rows:
        runs.setdefault(r.run_dir, []).append(r)
    lines = []
    for same in runs.values():
        load = same[0].load
        modes = " and ".join(r.mode for r in same)
        for warning in load.warnings if load else []:
            lines.append(f"WARNING: {same[0].processes} process(es), {modes}: doubtful figures: {warning}")
    return lines


def write_json(path: Path, header: dict[str, Any], rows: list[Row]) -> None:
    points = [asdict(r) for r in rows]
    document = {**header, "definitions": SPEEDUP_DEFINITION, "load_rules": LOAD_RULES, "points": points}
    write_atomically(path, json.dumps(document, indent=2) + "\n")


def write_markdown(path: Path, title: str, facts: list[str], rows: list[Row], unit: str) -> str:
    """bench.md; returns the table."""
    table = markdown_table(rows, unit)
    text = [f"# {title}", "", *(f"- {line}" for line in [*load_warnings(rows), *facts, SPEEDUP_DEFINITION])]
    text += ["", table, "", "How busy this node was around each point:", "", load_table(rows), ""]
    text += [f"- {LOAD_RULES}", ""]
    write_atomically(path, "\n".join(text))
    return table


def plot_scaling(path: Path, rows: list[Row], title: str) -> None:
    """Measured speedup against processes, one line per mode, and the ideal line (speedup = n / base)."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    measured = [r for r in rows if r.speedup is not None and r.ideal is not None]
    ideal = sorted({(r.processes, r.ideal) for r in measured if r.ideal is not None})
    if ideal:
        ax.plot(*zip(*ideal, strict=True), "k--", linewidth=1, label="ideal")
    for mode in dict.fromkeys(r.mode for r in measured):
        points = sorted((r.processes, r.speedup) for r in measured if r.mode == mode and r.speedup is not None)
        ax.plot(*zip(*points, strict=True), "o-", linewidth=1.5, label=f"{mode} scaling")
    counts = sorted({r.processes for r in rows})
    ax.set_xticks(counts)
    ax.set_ylim(bottom=0)  # from zero, so that the gap to the ideal line is not magnified
    ax.set_xlabel("processes")
    ax.set_ylabel("speedup over the smallest count")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_figure(fig, path)
