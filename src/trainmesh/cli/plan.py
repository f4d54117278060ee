"""`trainmesh plan`: every layout of a job on a cluster, its memory per rank and step time, fastest first; the fastest
that fits is printed as a ready `trainmesh run` command.

Details: docs/internals.md#cliplanpy
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from trainmesh.apps.plan.cluster import (
    MAX_RANKS,
    Cluster,
    GiB,
    calibration_path,
    cluster_problem,
    for_nodes,
    load_calibration,
    read_cluster,
    size_unit,
)
from trainmesh.apps.plan.estimate import TIME_PARTS, Estimate
from trainmesh.apps.plan.rank_memory import MEMORY_PARTS
from trainmesh.apps.plan.search import Workload, mfu, plan_layouts
from trainmesh.config import Config, ConfigError
from trainmesh.job.spec import load_config

EXIT_NOTHING_FITS = 3  # distinct from a user error (2) and from a crash (1)
ASSUMPTIONS = (
    "memory: AdamW (two moments like each parameter, a 4-byte step per tensor); activations as autograd saves them "
    "in trainmesh's GPT with SDPA (no attention matrix kept), no dropout",
    "memory: a layout fits when its most loaded rank's total is within the device memory less a margin for what is "
    "not modelled (allocator fragmentation, NCCL's growing buffers): --memory-margin, 10% by default",
    "time: FLOPs = 72·L·h²·(1 + s/6h) + 6·h·V per token (attention non-causal, as Megatron counts); "
    "+ one forward of each checkpointed block",
    "time: collectives as ring bandwidth + latency (log2 n steps for all-reduce, n − 1 for all-gather and "
    "reduce-scatter) on the link their group crosses; "
    "data-parallel traffic hides behind compute up to the cluster's overlap; tensor and pipeline traffic never",
    "time: pipeline bubble (p − 1) slots for gpipe / 1f1b, (p − 1)/v for interleaved schedules",
)


def check_plan_flags(args: argparse.Namespace) -> None:
    """Refuse bad `plan` flags before anything runs (ConfigError naming the flag and what is allowed)."""
    problem = cluster_problem(args.cluster)
    if problem:
        raise ConfigError(problem)
    for flag, value in (("--nodes", args.nodes), ("--devices-per-node", args.devices_per_node), ("--top", args.top)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag}={value} must be at least 1")
    if args.nodes * (args.devices_per_node or 8) > MAX_RANKS:
        raise ConfigError(f"--nodes={args.nodes}: plan up to {MAX_RANKS:,} ranks (nodes × devices per node)")
    if args.memory_margin is not None and not 0 <= args.memory_margin < 1:
        raise ConfigError(
            f"--memory-margin={args.memory_margin}: the fraction of device memory kept free, from 0 to below 1 "
            "(e.g. 0.1)"
        )
    if args.global_batch is not None and args.global_batch < 1:
        raise ConfigError(f"--global-batch={args.global_batch} must be at least 1 (sequences per optimizer step)")
    if args.json and not Path(args.json).expanduser().parent.is_dir():
        raise ConfigError(f"--json={args.json}: the folder {Path(args.json).parent} does not exist. Fix: create it.")


def plan_command(args: argparse.Namespace, overrides: list[str]) -> tuple[str, int]:
    """`trainmesh plan`: calibrate if asked, estimate every layout on the cluster, write --json; the text to show
    (the table and the command to run) and the exit code. Every input is checked before anything is measured."""
    check_plan_flags(args)
    calibration = Path(args.calibration) if args.calibration else calibration_path()
    described = read_cluster_file(args, calibration)
    config = load_config(args.config, overrides, args.target)
    try:
        Workload.from_config(config, _config_global_batch(config, 1))  # a recipe the plan models, a whole batch
        if args.calibrate:
            from trainmesh.apps.plan.calibrate import calibrate

            calibrate(config, calibration)
            if args.cluster != "this":
                return f"calibration saved to {calibration}", 0
        base = described or read_cluster(args.cluster, calibration)
        cluster = for_nodes(base, args.nodes, args.devices_per_node)
        if args.memory_margin is not None:
            cluster = dataclasses.replace(cluster, memory_margin=args.memory_margin)
        work = Workload.from_config(config, args.global_batch or _config_global_batch(config, cluster.world_size))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    estimates = plan_layouts(config, work, cluster)
    if not estimates:
        raise ConfigError(
            f"no layout of {cluster.world_size} ranks splits a global batch of {work.global_batch} sequences for "
            f"this model. Fix: a --global-batch that is a multiple of {cluster.world_size}."
        )
    lines = [render(work, cluster, estimates, args.top), ""]
    best = next((e for e in estimates if e.fits), None)
    if best is None:
        lines.append("No layout fits the device memory: a smaller model, a shorter block_size, or more devices.")
    else:
        lines.append(
            f"Recommended: {best.candidate.name}, micro-batch {best.candidate.micro_batch} (of the layouts that fit "
            f"and are within the model's {cluster.time_error:.0%} of the fastest, the simplest):"
        )
        lines.append("  " + shlex.join(run_command(args, overrides, cluster, best, work.global_batch)))
        if cluster.nodes > 1:
            lines.append("  (on every node, with the address of the first node's rendezvous in place of <host:port>)")
    if args.json:
        Path(args.json).expanduser().write_text(json.dumps(to_json(work, cluster, estimates), indent=2) + "\n")
    return "\n".join(lines), 0 if best is not None else EXIT_NOTHING_FITS


def read_cluster_file(args: argparse.Namespace, calibration: Path) -> Cluster | None:
    """The --cluster file, read once and before anything is measured, so that a bad one is refused at once
    (ConfigError); None for a preset or `this`, and where --calibrate is to write that very file: measuring
    afresh is how a broken calibration is replaced."""
    path = Path(args.cluster)
    if not args.cluster.endswith(".json") or (args.calibrate and path.resolve() == calibration.resolve()):
        return None
    try:
        return load_calibration(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _config_global_batch(config: Config, world_size: int) -> int:
    """The config's global batch in sequences, or its micro-batch on every rank when it sets none."""
    train = config.train
    seq = getattr(config.model, "block_size", 1)
    if train.global_batch_tokens:
        if train.global_batch_tokens % seq:
            raise ValueError(
                f"train.global_batch_tokens={train.global_batch_tokens} is not a whole number of sequences of "
                f"{seq} tokens (model.block_size). Fix: a multiple of {seq}, or --global-batch in sequences."
            )
        return train.global_batch_tokens // seq
    return train.global_batch or train.micro_batch * world_size


def run_command(
    args: argparse.Namespace, overrides: list[str], cluster: Cluster, est: Estimate, global_batch: int
) -> list[str]:
    """`trainmesh run` with the config, the user's overrides (less those the layout sets) and the layout's."""
    command = ["trainmesh", "run", args.target]
    if args.config:
        command += ["--config", str(args.config)]
    command += ["--nproc-per-node", str(cluster.devices_per_node), "--nnodes", str(cluster.nodes)]
    if cluster.nodes > 1:
        command += ["--rdzv-endpoint", "<host:port>"]
    layout = est.candidate.overrides(global_batch)
    set_by_layout = {o.split("=", 1)[0] for o in layout}
    return command + [o for o in overrides if o.split("=", 1)[0] not in set_by_layout] + layout


def _assumed(cluster: Cluster) -> str:
    """What an uncalibrated cluster's times rest on, and the span they may be off by."""
    text = f"assumed: {cluster.efficiency:.0%} of peak"
    if len(cluster.efficiency_range) == 2:
        low, high = cluster.efficiency_range
        text += (
            f"; GPT training reaches {low:.0%}-{high:.0%} MFU on this device in practice, so a step's compute may "
            f"take {cluster.efficiency / high:.2f}-{cluster.efficiency / low:.2f}x the time below, and MFU be "
            f"{low / cluster.efficiency:.2f}-{high / cluster.efficiency:.2f}x"
        )
    return text + "; calibrate on a node for measured figures"


def render(work: Workload, cluster: Cluster, estimates: list[Estimate], top: int | None) -> str:
    spec = work.spec
    rows = estimates[:top] if top else estimates
    unit, scale = size_unit(max(e.total_memory for e in rows))

    def size(x: float) -> str:
        return f"{x / scale:6.2f}"

    dtype = work.precision.compute_dtype(work.tf32 and cluster.device == "cuda")
    source = f"calibrated ({cluster.calibrated})" if cluster.calibrated else _assumed(cluster)
    lines = [
        f"model: GPT {spec.n_params / 1e6:.1f}M parameters (L={spec.n_layer}, h={spec.n_embd}, heads={spec.n_head}, "
        f"seq={spec.seq}, vocab={spec.vocab}), {work.precision.name}; global batch {work.global_batch} sequences "
        f"= {work.tokens_per_step:,} tokens per step",
        f"cluster: {cluster.name}, {cluster.nodes} node(s) × {cluster.devices_per_node} {cluster.device} device(s) of "
        f"{cluster.memory / GiB:.1f} GiB ({cluster.usable_memory / GiB:.1f} usable, a {cluster.memory_margin:.0%} "
        f"margin); {cluster.flops(dtype) / 1e12:.3g} TFLOP/s achievable in {dtype} "
        f"({source})",
        "",
        f"{'layout':<26} {'micro':>5} {'accum':>5} | {unit + '/rank':>8} {'params':>6} {'grads':>6} {'optim':>6} "
        f"{'act':>6} {'temp':>6} {'fits':>4} | {'step s':>8} {'comp':>5} {'bubl':>5} {'comm':>5} {'opt':>5} "
        f"{'offl':>5} | {'tok/s':>9} {'MFU':>5}",
    ]
    lines.append("-" * len(lines[-1]))
    for est in rows:
        c, m, t = est.candidate, est.memory, est.time
        accum = work.global_batch // (c.dp * c.micro_batch)
        share = {k: t[k] / est.step_time for k in TIME_PARTS}
        lines.append(
            f"{c.name:<26} {c.micro_batch:5d} {accum:5d} | {size(est.total_memory):>8} {size(m['params'])} "
            f"{size(m['grads'])} {size(m['optimizer'])} {size(m['activations'])} "
            f"{size(m['temporaries'] + m['gathered'])} {'yes' if est.fits else 'NO':>4} | {est.step_time:8.3f} "
            + " ".join(f"{share[k]:5.0%}" for k in TIME_PARTS)
            + f" | {work.tokens_per_step / est.step_time:9.3g} {mfu(work, est, cluster):5.1%}"
        )
    if len(rows) < len(estimates):
        lines.append(f"... {len(estimates) - len(rows)} more (--top to show more, --json for all)")
    lines += ["", "assumptions:"] + [f"  - {a}" for a in (*ASSUMPTIONS, *cluster.notes)]
    return "\n".join(lines)


def to_json(work: Workload, cluster: Cluster, estimates: list[Estimate]) -> dict[str, Any]:
    spec = work.spec
    return {
        "model": {"n_params": spec.n_params, "n_layer": spec.n_layer, "n_embd": spec.n_embd, "n_head": spec.n_head},
        "precision": work.precision.name,
        "global_batch": work.global_batch,
        "cluster": cluster.name,
        "world_size": cluster.world_size,
        "times": {  # what the step times and MFU rest on
            "basis": "calibrated" if cluster.calibrated else "assumed",
            "efficiency": cluster.efficiency,
            "efficiency_in_practice": list(cluster.efficiency_range),
            "relative_error": cluster.time_error,
        },
        "memory_margin": cluster.memory_margin,
        "assumptions": [*ASSUMPTIONS, *cluster.notes],
        "layouts": [
            {
                "name": e.candidate.name,
                "overrides": e.candidate.overrides(work.global_batch),
                "fits": e.fits,
                "stage": e.stage,
                "memory_bytes": {k: e.memory[k] for k in MEMORY_PARTS},
                "host_bytes": e.host,
                "time_s": e.time,
                "step_s": e.step_time,
                "mfu": mfu(work, e, cluster),
            }
            for e in estimates
        ],
    }


def cmd_plan(args: argparse.Namespace, overrides: list[str]) -> int:
    """`trainmesh plan`: the table and the command to run, on stdout."""
    text, code = plan_command(args, overrides)
    print(text)
    return code
