"""What a bench runs: the modes and process counts asked for, checked against the machine before anything starts, and
one `Point` per (mode, count) with the batch that mode gives it.

Details: docs/internals.md#appsbenchpointspy
"""

from __future__ import annotations

import contextlib
import math
import os
import platform
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from trainmesh.config import Config, ConfigError
from trainmesh.core.env import read_var, vars_set
from trainmesh.core.errors import UserError
from trainmesh.job.spec import Job, load_config, resolve
from trainmesh.strategies import resolve_parallelism

MODES = ("weak", "strong")
MODE_CHOICES = (*MODES, "both")
DEFAULT_STEPS = 20
DEFAULT_WARMUP = 5
MAX_DEFAULT_COUNT = 1024  # the powers of two stop here, whatever the machine claims


class BenchError(UserError, ValueError):
    """A bench that cannot run as asked; the message names the flag and the fix."""


def parse_modes(text: str) -> tuple[str, ...]:
    """--mode weak | strong | both -> the modes to run, in table order."""
    if text not in MODE_CHOICES:
        raise BenchError(
            f"--mode={text!r} is not a scaling mode; choose one of: {', '.join(MODE_CHOICES)} (weak: the batch per "
            "process stays fixed; strong: the global batch stays fixed). Fix: e.g. --mode weak"
        )
    return MODES if text == "both" else (text,)


def parse_counts(text: str | None) -> list[int] | None:
    """--nprocs 1,2,4 -> sorted distinct process counts per node; None (not given) -> the default powers of two."""
    if text is None:
        return None
    items = [item.strip() for item in text.split(",")]
    bad = [item for item in items if not item.isdigit() or int(item) < 1]
    if bad or not items:
        raise BenchError(
            f"--nprocs={text!r}: {', '.join(repr(b) for b in bad) or 'nothing'} is not a process count; give whole "
            "numbers of at least 1, separated by commas. Fix: e.g. --nprocs 1,2,4 (or leave --nprocs out for 1, 2, "
            "4, ... up to what the machine runs at once)"
        )
    return sorted({int(item) for item in items})


def check_steps(steps: int, warmup: int) -> None:
    if steps < 1:
        raise BenchError(f"--steps={steps}: each point needs at least 1 timed step. Fix: e.g. --steps {DEFAULT_STEPS}")
    if warmup < 0:
        raise BenchError(f"--warmup={warmup}: must be 0 or more (steps run before the timed ones). Fix: --warmup 0")


@dataclass(frozen=True)
class Machine:
    """What one node can run at once, and the facts recorded in bench.json."""

    device: str
    """cpu | cuda | mps: where the job's ranks compute (dist.device, `auto` resolved)."""
    slots: int
    """Processes this node runs side by side without time-sharing: its GPUs, or its cores / threads per rank."""
    cores: int
    """CPU cores this process may use (its affinity)."""
    threads_per_rank: int
    """OMP_NUM_THREADS of each rank: the environment's, else 1 (see `rank_threads`)."""
    name: str
    """The GPU's or the CPU's model name."""

    @classmethod
    def of(cls, config: Config) -> Machine:
        device = config.dist.device
        if device == "auto":  # as the Runtime picks, less mps: auto means mps for one process only
            device = "cuda" if torch.cuda.is_available() else "cpu"
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        threads = _threads_per_rank()
        if device == "cuda":
            gpus = torch.cuda.device_count()
            return cls(device, gpus, cores, threads, torch.cuda.get_device_name(0) if gpus else "no GPU")
        slots = 1 if device == "mps" else max(1, cores // threads)
        return cls(device, slots, cores, threads, _cpu_name())

    def describe_slots(self) -> str:
        if self.device == "cuda":
            return f"{self.slots} GPU(s)"
        if self.device == "mps":
            return "one MPS device"
        return f"{self.cores} CPU core(s) at {self.threads_per_rank} thread(s) per rank"


def _threads_per_rank() -> int:
    raw = read_var("OMP_NUM_THREADS")
    return int(raw) if raw.isdigit() and int(raw) > 0 else 1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@contextlib.contextmanager
def rank_threads(machine: Machine) -> Iterator[None]:
    """Every point's ranks run with the same OMP_NUM_THREADS. torchrun sets 1 only when it starts several
    processes, so without this the 1-process point would use every core and the baseline would be unfair."""
    with vars_set({"OMP_NUM_THREADS": str(machine.threads_per_rank)}):
        yield


def choose_counts(counts: list[int] | None, nproc_per_node: str, machine: Machine, oversubscribe: bool) -> list[int]:
    """The process counts per node: --nprocs, else 1, 2, 4, ... up to --nproc-per-node (a number) or the
    machine's slots; refused above --nproc-per-node, and above the slots unless --oversubscribe."""
    cap = machine.slots if nproc_per_node == "auto" else int(nproc_per_node)  # LaunchOptions.check ran before
    if counts is None:
        counts = [1 << k for k in range(MAX_DEFAULT_COUNT.bit_length()) if 1 << k <= max(cap, 1)]
    elif nproc_per_node != "auto" and counts[-1] > cap:
        raise BenchError(
            f"--nprocs asks for {counts[-1]} processes per node, above --nproc-per-node={cap}. Fix: leave out "
            "--nproc-per-node (each point sets its own count), or give --nprocs counts up to it."
        )
    too_many = [n for n in counts if n > machine.slots]
    if too_many and not oversubscribe:
        fitting = ",".join(str(1 << k) for k in range(8) if 1 << k <= machine.slots) or "1"
        raise BenchError(
            f"--nprocs: {', '.join(map(str, too_many))} process(es) per node is more than this machine runs side by "
            f"side: {machine.slots} ({machine.describe_slots()}). More would share cores or devices and measure "
            f"time-sharing, not scaling. Fix: --nprocs {fitting}, or add --oversubscribe to run them anyway."
        )
    return counts


@dataclass(frozen=True)
class Point:
    """One measurement: a mode at a process count, with the job it runs."""

    mode: str
    nprocs: int
    """Processes per node (torchrun's --nproc-per-node for this point)."""
    job: Job
    """The resolved job (world size = nprocs × nodes); its batch split is the point's."""

    @property
    def world_size(self) -> int:
        return self.job.world_size

    @property
    def run_name(self) -> str:
        """The point's run folder: the same job in both modes (the base count) gets one folder and one run."""
        b = self.job.batch
        return f"n{self.world_size}-gb{b.global_batch}-mb{b.micro_batch}"


def timing_overrides(steps: int, warmup: int) -> list[str]:
    """Keys every point sets: exactly warmup + steps steps, a record per step, nothing else inside the timed
    steps (no evaluation between steps, no checkpoint, no sample at the end), no progress bar, no experiment tracker
    (a measurement is not an experiment, and a tracker's threads and processes would take CPU from the steps)."""
    return [
        f"--train.max_steps={warmup + steps}",
        "--run.log_every=1",
        "--train.eval_every=0",  # 0: no evaluation between steps (the loop still evaluates at step 0 and the end)
        "--checkpoint.every=0",
        "--checkpoint.final=false",
        "--checkpoint.resume=false",
        "--sample.max_new_tokens=0",
        "--run.progress=false",
        '--log.sinks=["tensorboard"]',
    ]


def bench_points(
    config_path: str | None,
    overrides: list[str],
    recipe: str,
    modes: tuple[str, ...],
    counts: list[int],
    nnodes: int,
    extra: list[str],
) -> list[Point]:
    """Every (mode, count) point, each resolved into its job (all checks), in table order. `overrides`: the
    user's; `extra`: the timing overrides, which win over them."""
    base_config = load_config(config_path, [*overrides, *extra], recipe)
    base = resolve(base_config, counts[0] * nnodes)
    per_rank = base.batch.global_batch // base.batch.dp_size  # = micro-batch × accumulation steps
    ranks = {n: _dp_size(base_config, n * nnodes) for n in counts}  # data-parallel ranks (pp, tp take the rest)
    points = []
    for mode in modes:
        for n in counts:
            if mode == "weak":
                global_batch, micro = per_rank * ranks[n], base.batch.micro_batch
            else:
                global_batch, micro = base.batch.global_batch, _strong_micro_batch(base, n, ranks, counts[0])
            batch = [f"--train.global_batch={global_batch}", "--train.global_batch_tokens=0"]
            batch.append(f"--train.micro_batch={micro}")
            job = resolve(load_config(config_path, [*overrides, *extra, *batch], recipe), n * nnodes)
            points.append(Point(mode, n, job))
    return points


def _dp_size(config: Config, world: int) -> int:
    try:
        return resolve_parallelism(config.parallel, world).dims.dp_size
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _strong_micro_batch(base: Job, n: int, ranks: dict[int, int], base_count: int) -> int:
    """The largest micro-batch of at most the base's that divides global / ranks (refused if that is fractional)."""
    global_batch, micro = base.batch.global_batch, base.batch.micro_batch
    if global_batch % ranks[n]:
        fitting = [c for c, r in ranks.items() if global_batch % r == 0]
        # A global batch every count divides, which the base point (micro-batch × its ranks) also divides.
        unit = math.lcm(micro * base.batch.dp_size, *ranks.values())
        raise BenchError(
            f"--mode strong keeps the global batch of the {base_count}-process point ({base.batch.describe()}) and "
            f"splits it over the ranks, but --nprocs {n} gives {ranks[n]} data-parallel rank(s), and {global_batch} / "
            f"{ranks[n]} = {global_batch / ranks[n]:.2f} samples per rank is not a whole number. Fix: --nprocs with "
            f"counts that divide {global_batch} (of those given: {','.join(map(str, fitting)) or 'none'}), "
            f"--train.global_batch={unit * -(-global_batch // unit)} (every count divides it), or --mode weak."
        )
    per_rank = global_batch // ranks[n]
    return max(d for d in range(1, min(micro, per_rank) + 1) if per_rank % d == 0)
