"""`trainmesh bench <recipe> --config F [--mode weak|strong|both] [--nprocs 1,2,4] [--section.key=value ...]`.

1. Check everything before anything is written: the flags, the machine (how many processes it runs side by side),
   the config and every point's job (apps/bench/points.py).
2. Claim the bench folder, `<run.out_dir>/<recipe>-bench-<date>-<time>/` (or --run-id), as `trainmesh run`
   claims a run folder.
3. Run each distinct job once, one after the other, as `trainmesh run` launches one (job/launcher.py launch_into):
   its own run folder in the bench folder, its own torchrun. A point that fails is reported, and the rest run.
4. Read each point's metrics.jsonl and write bench.json, bench.md and scaling.png (apps/bench/report.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import shlex
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainmesh.apps.bench.load import PointLoad, watch_point
from trainmesh.apps.bench.points import (
    BenchError,
    Machine,
    Point,
    bench_points,
    check_steps,
    choose_counts,
    parse_counts,
    parse_modes,
    rank_threads,
    timing_overrides,
)
from trainmesh.apps.bench.report import (
    BENCH_JSON,
    BENCH_MD,
    SCALING_PNG,
    Row,
    add_scaling,
    load_warnings,
    measure,
    plot_scaling,
    write_json,
    write_markdown,
)
from trainmesh.config import Config
from trainmesh.config.loader import config_to_dict
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_TERMINATED, EXIT_USER_ERROR, UserError
from trainmesh.core.logging import get_logger
from trainmesh.core.versions import versions
from trainmesh.job.launcher import check_launch, launch_into, launch_options
from trainmesh.job.rundir import RunFolder
from trainmesh.job.spec import Job, load_config
from trainmesh.launch import LaunchOptions
from trainmesh.metrics.sinks import METRICS_FILE, read_metrics

log = get_logger(__name__)


def cmd_bench(args: argparse.Namespace, overrides: list[str]) -> int:
    """The bench (see the module docstring); the exit code: 0, or the first failed point's."""
    modes, counts = parse_modes(args.mode), parse_counts(args.nprocs)
    check_steps(args.steps, args.warmup)
    opts = launch_options(args)
    config = load_config(args.config, overrides, args.target)
    check_launch(config, opts)
    low, high = opts.node_bounds()
    if low != high:
        raise BenchError(
            f"--nnodes={opts.nnodes} is an elastic range, but each point of a bench needs a fixed number of "
            f"processes. Fix: --nnodes {low} (or {high})."
        )
    machine = Machine.of(config)
    counts = choose_counts(counts, opts.nproc_per_node, machine, args.oversubscribe)
    extra = timing_overrides(args.steps, args.warmup)
    points = bench_points(args.config, overrides, args.target, modes, counts, low, extra)
    # Everything is checked: from here on the bench writes.
    folder = _claim_folder(config, opts)
    bench_dir = folder.path
    log.info("bench folder: %s; %s", bench_dir, _plan_line(points, modes, args))
    with folder, rank_threads(machine):
        codes, loads = _run_points(points, opts, bench_dir, folder.job_id, machine)
        if folder.joined:  # a node of a multi-node bench whose folder another node holds: that node reports
            log.info("the node holding %s writes the report", bench_dir)
            return _first_failure(codes.values())
        ran = [bench_dir / name / METRICS_FILE for name, code in codes.items() if code == 0]
        here = [path.is_file() for path in ran]
        if opts.multi_node and ran and not any(here):  # no shared file system: rank 0 ran on another node
            log.info("rank 0 of the points ran on another node (no %s here): that node writes the report", METRICS_FILE)
            return _first_failure(codes.values())
        if opts.multi_node and not all(here):
            log.error(
                "the points' %s are spread over the nodes (rank 0 of each point ran where its rendezvous put it), so "
                "no node can write the whole report. Fix: a run.out_dir on a file system all nodes share.",
                METRICS_FILE,
            )
            return _first_failure(codes.values()) or 1
        rows = _rows(points, codes, loads, bench_dir, args.warmup, args.steps)
        _write_report(rows, points[0].job, machine, bench_dir, args, counts, low)
    failed = [r for r in rows if r.measured is None]
    for row in failed:
        log.error("%s scaling, %d process(es): %s; run folder %s", row.mode, row.processes, row.error, row.run_dir)
    for warning in load_warnings(rows):
        log.warning("%s (bench.md has the load of every point)", warning)
    log.info("bench folder: %s (%s, %s, %s)", bench_dir, BENCH_JSON, BENCH_MD, SCALING_PNG)
    return _first_failure(codes.values()) or (1 if failed else 0)


def _claim_folder(config: Config, opts: LaunchOptions) -> RunFolder:
    """The bench folder (named like a run folder), with the launch id its lock is held under. The nodes of a
    multi-node bench derive both from what they share, as `trainmesh run` does."""
    out_dir, name, recipe = Path(config.run.out_dir), config.run.id, config.run.recipe
    suffix = opts.default_run_suffix()
    if suffix:
        return RunFolder.named(out_dir, name or RunFolder.shared_name(f"{recipe}-bench", suffix), job_id=suffix)
    if name:
        if (out_dir / name).exists():
            raise BenchError(
                f"--run-id {name}: {out_dir / name} already exists, and a bench writes new run folders. Fix: another "
                "--run-id, or leave it out for a new <recipe>-bench-<date>-<time> folder."
            )
        return RunFolder.named(out_dir, name)
    return RunFolder.new(out_dir, f"{recipe}-bench")


def _plan_line(points: list[Point], modes: tuple[str, ...], args: argparse.Namespace) -> str:
    counts = sorted({p.world_size for p in points})
    return (
        f"{' and '.join(modes)} scaling at {', '.join(map(str, counts))} process(es), "
        f"{args.warmup} warm-up + {args.steps} timed steps per point"
    )


def _run_points(
    points: list[Point], opts: LaunchOptions, bench_dir: Path, launch_id: str, machine: Machine
) -> tuple[dict[str, int], dict[str, PointLoad]]:
    """Launch each distinct job once (the base count's job is the same in both modes); their exit codes and the
    load of this node around them (apps/bench/load.py), by run folder name. Stops early only when stopped (SIGTERM,
    Ctrl-C)."""
    runs: dict[str, list[Point]] = {}  # run folder name -> the points of that job
    for p in points:
        runs.setdefault(p.run_name, []).append(p)
    codes: dict[str, int] = {}
    loads: dict[str, PointLoad] = {}
    for i, (name, same_job) in enumerate(runs.items()):
        point, in_modes = same_job[0], " and ".join(p.mode for p in same_job)
        log.info(
            "bench point %d/%d: %s scaling, %d process(es): %s", i + 1, len(runs), in_modes, point.world_size, name
        )
        launch = functools.partial(_launch_point, point, point_options(opts, point, i), bench_dir, name, launch_id)
        codes[name], loads[name] = watch_point(launch, point.nprocs * machine.threads_per_rank, machine.cores)
        for warning in loads[name].warnings:
            log.warning("bench point %s: doubtful figures: %s", name, warning)
        if codes[name] in (EXIT_PREEMPTED, EXIT_INTERRUPTED, EXIT_TERMINATED):  # a stop, with a checkpoint or not
            log.warning("stopped: the bench ends here, and reports the points that ran")
            break
    return codes, loads


def _launch_point(point: Point, opts: LaunchOptions, bench_dir: Path, name: str, launch_id: str) -> int:
    """Run one point's job into `bench_dir/name`, as `trainmesh run` would; its exit code."""
    job = _placed(point.job, bench_dir, name)
    try:
        return launch_into(opts, [job], job, RunFolder.named(bench_dir, name, f"{launch_id}-{name}"))
    except UserError as e:  # e.g. a port in use: this point fails, the others may still run
        log.error("%s", e)
        return EXIT_USER_ERROR


def _placed(job: Job, bench_dir: Path, name: str) -> Job:
    """The point's job as its run folder, `bench_dir/name`, records it (run.out_dir and run.id)."""
    run = dataclasses.replace(job.config.run, out_dir=str(bench_dir))
    return dataclasses.replace(job, config=dataclasses.replace(job.config, run=run)).named(name, resume=False)


def point_options(opts: LaunchOptions, point: Point, index: int) -> LaunchOptions:
    """The launch of one point: its process count, and a rendezvous of its own on several nodes (every node
    counts the points alike), so that a node that runs ahead never meets the previous point's."""
    changes: dict[str, Any] = {"nproc_per_node": str(point.nprocs)}
    if opts.rdzv_endpoint:
        changes["rdzv_id"] = f"{opts.rendezvous_id()}-{index}"
    elif opts.multi_node and opts.master_port:
        changes["master_port"] = opts.master_port + index  # static rendezvous: point i meets at --master-port + i
    return dataclasses.replace(opts, **changes)


def _rows(
    points: list[Point], codes: dict[str, int], loads: dict[str, PointLoad], bench_dir: Path, warmup: int, steps: int
) -> list[Row]:
    rows = []
    for p in points:
        b, run_dir = p.job.batch, bench_dir / p.run_name
        units = b.tokens_per_step or b.global_batch
        row = Row(
            p.mode,
            p.world_size,
            b.global_batch,
            b.micro_batch,
            b.accum_steps,
            units,
            b.dp_size,
            str(run_dir),
            codes.get(p.run_name),
            load=loads.get(p.run_name),
        )
        if row.exit_code is None:
            row.error = "not run (the bench was stopped)"
        elif row.exit_code != 0:
            row.error = f"failed with exit code {row.exit_code}"
        elif not (run_dir / METRICS_FILE).is_file():
            row.error = f"no {METRICS_FILE} in its run folder"
        else:
            try:
                row.measured = measure(read_metrics(run_dir / METRICS_FILE), warmup, steps, units)
            except (OSError, ValueError, KeyError) as e:
                row.error = f"unreadable {METRICS_FILE}: {e}"
        rows.append(row)
    add_scaling(rows)
    return rows


def _write_report(
    rows: list[Row],
    base: Job,
    machine: Machine,
    bench_dir: Path,
    args: argparse.Namespace,
    counts: list[int],
    nodes: int,
) -> None:
    """bench.json, bench.md, scaling.png, and the table in the log."""
    unit = "tokens" if base.batch.tokens_per_sample else "samples"
    backend = base.config.dist.backend
    if backend == "auto":
        backend = "nccl" if machine.device == "cuda" else "gloo"
    command = shlex.join(getattr(args, "command_line", None) or ["trainmesh", "bench", args.target])
    facts = {
        **dataclasses.asdict(machine),
        "backend": backend,
        "nodes": nodes,
        **versions(),
    }
    header = {
        "command": command,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "recipe": base.config.run.recipe,
        "modes": list(dict.fromkeys(r.mode for r in rows)),
        "nprocs_per_node": counts,
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "throughput_unit": f"{unit}/s",
        "machine": facts,
        "config": config_to_dict(base.config),
    }
    write_json(bench_dir / BENCH_JSON, header, rows)
    where = f"{nodes} node(s), " if nodes > 1 else ""
    lines = [
        f"command: `{command}`",
        f"machine: {where}{machine.device} ({machine.name}), {machine.describe_slots()}; {backend}; "
        f"torch {facts['torch']}",
        f"{args.warmup} warm-up steps, then {args.steps} timed steps per point (medians over them)",
    ]
    title = f"trainmesh bench {base.config.run.recipe}"
    table = write_markdown(bench_dir / BENCH_MD, title, lines, rows, unit)
    plot_scaling(bench_dir / SCALING_PNG, rows, f"{title}: {machine.device}, {backend}, {machine.describe_slots()}")
    log.info("scaling (%s; step times are medians, phases are rank 0's):\n%s", unit, table)


def _first_failure(codes: Iterable[int]) -> int:
    return next((code for code in codes if code != 0), 0)
