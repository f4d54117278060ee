"""`trainmesh plan --calibrate`: measure this machine (compute, memory bandwidth, contention, tensor parallelism and
FSDP, collectives), fit each figure to the model estimate.py uses, and save them.

Details: docs/internals.md#appsplancalibratepy
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainmesh.apps.plan.cluster import COLLECTIVES, PRESETS, Cluster, Cost, Link, save_calibration
from trainmesh.apps.plan.estimate import OPTIMIZER_BYTES_PER_PARAM
from trainmesh.apps.plan.layouts import Candidate
from trainmesh.apps.plan.memory import PrecisionBytes
from trainmesh.apps.plan.model import ModelSpec
from trainmesh.apps.plan.search import Workload, estimate
from trainmesh.config import Config
from trainmesh.config.schema import DistConfig, ParallelConfig
from trainmesh.core.machine import host_memory
from trainmesh.launch.spawn import run_distributed
from trainmesh.recipes.gpt.model import GPT, GPTConfig, summed_lm_loss
from trainmesh.recipes.gpt.parallel import parallelize_gpt
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies.plan import ParallelPlan
from trainmesh.train.optim import build_optimizer

log = logging.getLogger("trainmesh")
SIZES = [2**k for k in range(10, 25, 2)]  # 1 KiB .. 16 MiB
WARMUP, STEPS = 2, 5
# torch 2.13 renames the tensor forms of all-gather and reduce-scatter (the old names warn); older torch has only those
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def calibrate(config: Config, path: Path) -> Cluster:
    """Measure this machine with `config`'s model, save the result at `path` and return it."""
    model = config.model
    if not isinstance(model, GPTConfig):
        raise ValueError("plan --calibrate times the gpt recipe's model; run it with the gpt recipe")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    log.info("calibrating on %s with GPT %s, micro-batch %d ...", device, model.size, config.train.micro_batch)
    small = max(1, config.train.micro_batch // 4)
    compute = run_distributed(_time_model, 1, (config, [config.train.micro_batch, small]), timeout_s=900)[0]
    links = _measure_links() if device == "cpu" else None
    cluster = _cluster(config, device, compute, links)
    if links is not None and (os.cpu_count() or 1) >= 2:
        cluster = _calibrate_sharing(config, cluster, compute)
    save_calibration(cluster, path)
    log.info(
        "calibration saved to %s: %.3g GFLOP/s, %.3g GB/s memory, all-reduce %.3g GB/s",
        path,
        cluster.peak_flops["fp32"] / 1e9,
        cluster.mem_bandwidth / 1e9,
        cluster.intra.costs["all_reduce"].bandwidth / 1e9,
    )
    return cluster


def _calibrate_sharing(config: Config, cluster: Cluster, compute: dict[str, Any]) -> Cluster:
    """On a CPU: how much slower a core computes when every core does (`busy_slowdown`), the share of the work
    tensor parallelism over two processes does not divide (`tp_unsplit`), and FSDP's own time per unit
    (`fsdp_unit_overhead`)."""
    model = config.model
    assert isinstance(model, GPTConfig)
    micro = config.train.micro_batch
    busy = run_distributed(_time_model, os.cpu_count() or 1, (config, [micro]), timeout_s=900)
    alone = compute["forward_backward_s"][micro] + compute["optimizer_s"]
    slowest = max(r["forward_backward_s"][micro] + r["optimizer_s"] for r in busy)
    cluster = replace(cluster, busy_slowdown=max(1.0, slowest / alone))
    fsdp = max(run_distributed(_time_layout, 2, (config, "fsdp", ParallelConfig()), timeout_s=900))
    cluster = replace(cluster, fsdp_unit_overhead=_fit_fsdp(config, cluster, fsdp))
    if model.n_head % 2 or model.vocab_size % 2:
        return cluster
    seconds = max(run_distributed(_time_layout, 2, (config, "auto", ParallelConfig(tp=2)), timeout_s=900))
    return replace(cluster, tp_unsplit=_fit_tensor_parallel(config, cluster, seconds))


def _cluster(config: Config, device: str, compute: dict[str, Any], links: Link | None) -> Cluster:
    spec = ModelSpec(config.model)  # type: ignore[arg-type]
    flops, overhead = _fit_compute(spec, compute["forward_backward_s"])
    bandwidth = spec.n_params * OPTIMIZER_BYTES_PER_PARAM / compute["optimizer_s"]
    dtype = PrecisionBytes(config.train.precision).compute_dtype(config.train.tf32 and device == "cuda")
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    source = f"{os.uname().nodename}, {when}, GPT {spec.n_params / 1e6:.1f}M in {config.train.precision}"
    if device == "cuda":
        name = torch.cuda.get_device_name().lower()
        preset = next((p for key, p in PRESETS.items() if key in name), PRESETS["h100"])
        return replace(
            preset,
            name=f"this ({torch.cuda.get_device_name()})",
            memory=float(torch.cuda.get_device_properties(0).total_memory),
            devices_per_node=torch.cuda.device_count(),
            efficiency=min(1.0, flops / preset.peak_flops[dtype]),  # of the datasheet peak, which MFU stays against
            mem_bandwidth=bandwidth,
            step_overhead=overhead,
            forward_share=compute["forward_share"],
            efficiency_range=(),  # measured: no longer an assumption with a span
            calibrated=source,
            notes=(
                f"efficiency measured in {dtype}; the other precisions are taken at the same fraction of their peak",
                f"links are the {preset.name} preset's (one process calibrates: no peer to time)",
            ),
        )
    assert links is not None
    cores = os.cpu_count() or 1
    return Cluster(
        name="this (CPU)",
        device="cpu",
        memory=host_memory() / cores,
        devices_per_node=cores,
        nodes=1,
        peak_flops=dict.fromkeys(("bf16", "tf32", "fp32"), flops),
        efficiency=1.0,
        mem_bandwidth=bandwidth,
        intra=links,
        inter=links,
        host=Cost(float("inf"), 0.0),
        host_bandwidth=bandwidth,
        overhead=compute["rss_before_model"],
        overlap=0.0,
        step_overhead=overhead,
        forward_share=compute["forward_share"],
        calibrated=source,
        notes=(
            f"CPU: one process per core, one thread each; FLOP/s measured in {config.train.precision} only",
            "CPU: collectives measured between two gloo processes; communication does not overlap compute",
        ),
    )


def _resident() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return float(line.split()[1]) * 1024
    return 0.0


def _fit_tensor_parallel(config: Config, cluster: Cluster, seconds: float) -> float:
    """The share of the per-token work that tensor parallelism over 2 ranks left whole (Cluster.tp_unsplit), from
    the measured forward + backward `seconds` of parallel.tp=2: what the estimate, with every FLOP divided and its
    tensor-parallel all-reduces, leaves unexplained, over the half of the work it took as divided."""
    micro = config.train.micro_batch
    work = Workload.from_config(config, micro)
    divided = estimate(work, Candidate("single", 1, 2, 1, 1, 0, micro, 1), replace(cluster, devices_per_node=2))
    dtype = work.precision.compute_dtype(config.train.tf32 and cluster.device == "cuda")
    # as the estimate takes it: two processes at once, each slowed by sharing the node
    per_token_work = work.spec.train_flops_per_token() * micro * work.spec.seq / cluster.flops(dtype)
    per_token_work *= cluster.busy_slowdown
    unexplained = seconds - divided.time["compute"] - divided.time["comm"]
    return min(1.0, max(0.0, unexplained / (per_token_work / 2)))


def reference_step_seconds(config: Config) -> float:
    """This machine's speed now: one process's forward, backward and optimizer step of `config`'s GPT at its
    micro-batch (medians), timed as the calibration times it. A validation taken over minutes times this beside
    each measurement, to tell the machine's drift from the model's error."""
    timed = run_distributed(_time_model, 1, (config, [config.train.micro_batch]), timeout_s=300)[0]
    return float(timed["forward_backward_s"][config.train.micro_batch] + timed["optimizer_s"])


def _fit_fsdp(config: Config, cluster: Cluster, seconds: float) -> float:
    """FSDP's own seconds per unit per micro-step (Cluster.fsdp_unit_overhead: its hooks, bookkeeping and the
    copies the estimate does not see), from the measured forward + backward `seconds` of fsdp over 2 ranks: what
    the estimate leaves unexplained, per unit."""
    micro = config.train.micro_batch
    work = Workload.from_config(config, 2 * micro)
    sharded = estimate(work, Candidate("fsdp", 1, 1, 1, 2, 0, micro, 1), replace(cluster, devices_per_node=2))
    units = work.spec.n_layer + 1
    return max(0.0, (seconds - sharded.time["compute"] - sharded.time["comm"]) / units)


def _fit_compute(spec: ModelSpec, seconds: dict[int, float]) -> tuple[float, float]:
    """(FLOP/s, seconds per step that do not grow with tokens) from forward + backward times at two micro-batches:
    t = overhead + FLOPs / rate. A measurement whose small micro-batch is not faster gives no overhead."""
    points = sorted(seconds.items(), reverse=True)
    (big, t_big), (small, t_small) = points[0], points[-1]  # the same point when one micro-batch was timed
    per_sequence = spec.train_flops_per_token() * spec.seq
    if big == small or t_big <= t_small:
        return per_sequence * big / t_big, 0.0
    rate = per_sequence * (big - small) / (t_big - t_small)
    overhead = t_big - per_sequence * big / rate
    return (rate, overhead) if overhead > 0 else (per_sequence * big / t_big, 0.0)


def _time_model(rank: int, config: Config, micro_batches: list[int]) -> dict[str, Any]:
    """Median forward + backward seconds of `config`'s GPT on this device (one process) at each micro-batch, the
    forward's share of them (at the first), and the median optimizer step with clipping."""
    del rank
    dist.init_process_group("gloo")
    rss = _resident()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = config.model
    assert isinstance(cfg, GPTConfig)
    model = GPT(cfg).to(device)
    if config.train.precision == "bf16-true":
        model.to(torch.bfloat16)
    optimizer = build_optimizer(model, config.optim, device)
    fb: dict[int, float] = {}
    forward: list[float] = []
    opt: list[float] = []
    for micro in micro_batches:  # one block of steps each: alternating shapes would cost the allocator time
        times = []
        for step in range(WARMUP + STEPS):
            seconds = _forward_backward(model, config, micro, device)
            start = time.perf_counter()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # as the training loop does
            _sync(device)
            if step >= WARMUP:
                times.append(seconds)
                opt.append(time.perf_counter() - start)
                forward += [seconds[0] / sum(seconds)] if micro == micro_batches[0] else []
        fb[micro] = statistics.median(sum(t) for t in times)
    return {
        "forward_backward_s": fb,
        "forward_share": statistics.median(forward),
        "optimizer_s": statistics.median(opt),
        "rss_before_model": rss,
    }


def _forward_backward(model: nn.Module, config: Config, micro: int, device: torch.device) -> tuple[float, float]:
    """Seconds of one forward and of its backward of `model` on `micro` random sequences, in `config`'s precision."""
    cfg = config.model
    assert isinstance(cfg, GPTConfig)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(config.train.precision)
    batch = torch.randint(cfg.vocab_size, (micro, cfg.block_size + 1), device=device)
    _sync(device)
    start = time.perf_counter()
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = summed_lm_loss(model(batch[:, :-1]), batch[:, 1:])
    _sync(device)
    middle = time.perf_counter()
    loss.backward()
    _sync(device)
    return middle - start, time.perf_counter() - middle


def _time_layout(rank: int, config: Config, strategy: str, parallel: ParallelConfig) -> float:
    """Median forward + backward seconds of `config`'s GPT on this process and its peers (on the CPU, gloo) under
    `strategy` and `parallel`, set up as trainmesh sets it up."""
    del rank
    cpu = DistConfig(device="cpu")
    runtime = Runtime(strategy=strategy, precision=config.train.precision, parallel=parallel, dist_config=cpu, seed=0)
    cfg = config.model
    assert isinstance(cfg, GPTConfig)
    model = runtime.setup(GPT(cfg), plan=ParallelPlan(tensor_parallel=parallelize_gpt))
    times = [_forward_backward(model, config, config.train.micro_batch, runtime.device) for _ in range(WARMUP + STEPS)]
    return statistics.median(sum(t) for t in times[WARMUP:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _measure_links() -> Link:
    times: list[dict[str, list[float]]] = run_distributed(_time_collectives, 2, (SIZES,), timeout_s=300)
    slowest = {kind: [max(r[kind][i] for r in times) for i in range(len(SIZES))] for kind in COLLECTIVES}
    return Link({kind: _fit(kind, slowest[kind]) for kind in COLLECTIVES})


def _fit(kind: str, seconds: list[float]) -> Cost:
    """Latency and bandwidth of cluster.Link's model at two ranks (one hop; all-reduce counts two), fitted to
    t = latency·hops + share·bytes/bandwidth by least squares on the relative error (small messages, where
    latency shows, weigh as much as large ones)."""
    share, hops = {"all_reduce": (1.0, 2), "p2p": (1.0, 1)}.get(kind, (0.5, 1))
    xs = [share * size for size in SIZES]
    weights = [1 / t**2 for t in seconds]
    sw = sum(weights)
    mean_x = sum(w * x for w, x in zip(weights, xs, strict=True)) / sw
    mean_t = sum(w * t for w, t in zip(weights, seconds, strict=True)) / sw
    covariance = sum(w * (x - mean_x) * (t - mean_t) for w, x, t in zip(weights, xs, seconds, strict=True))
    variance = sum(w * (x - mean_x) ** 2 for w, x in zip(weights, xs, strict=True))
    slope = max(covariance / variance, 1e-15)
    latency = max(0.0, (mean_t - slope * mean_x) / hops)
    return Cost(bandwidth=1 / slope, latency=latency)


def _time_collectives(rank: int, sizes: list[int]) -> dict[str, list[float]]:
    """Median seconds of each collective at each size (bytes of fp32), on this rank."""
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    out: dict[str, list[float]] = {kind: [] for kind in COLLECTIVES}
    for size in sizes:
        ops = _collectives(rank, torch.ones(size // 4), torch.ones(size // 4 // world))
        for kind, op in ops.items():
            samples = []
            for i in range(WARMUP + STEPS):
                dist.barrier()
                start = time.perf_counter()
                op()
                if i >= WARMUP:
                    samples.append(time.perf_counter() - start)
            out[kind].append(statistics.median(samples))
    return out


def _collectives(rank: int, full: torch.Tensor, part: torch.Tensor) -> dict[str, Callable[[], Any]]:
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "all_gather": lambda: _ALL_GATHER(full, part),
        "reduce_scatter": lambda: _REDUCE_SCATTER(part, full),
        "p2p": lambda: dist.send(full, 1) if rank == 0 else dist.recv(full, 0),
    }
