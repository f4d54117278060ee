"""How busy this node was around each bench point (load average, CPU time, time stolen by the hypervisor), recorded with
the point's figures, and when that makes them doubtful.

Details: docs/internals.md#appsbenchloadpy
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

WINDOW_S = 1.0
"""Seconds over which the CPU time before a point is measured (the previous point's processes are gone by then)."""
BUSY_MARGIN = 0.5
"""Cores other programs may keep busy beyond those a point leaves free."""
LOAD_MARGIN = 1.0
"""Tasks the 1-minute load average after a point may show beyond the cores (or the point's threads, if more)."""
STEAL_LIMIT = 0.05
"""The share of CPU time the hypervisor may steal during a point, or in the window before it."""
LOAD_RULES = (
    f"a point is doubtful when, in the {WINDOW_S:g} s before it, other programs kept more than {BUSY_MARGIN:g} core(s) "
    f"busy beyond those it leaves free; when the 1-minute load average after it exceeds the cores (or its threads) "
    f"by over {LOAD_MARGIN:g}; or when over {STEAL_LIMIT:.0%} of the CPU time was stolen (steal)"
)
"""The rules above in a line, for bench.md and bench.json."""


@dataclass(frozen=True)
class CpuSample:
    """This node at one moment."""

    time: float
    """time.monotonic(), seconds."""
    load: float
    """The 1-minute load average (tasks running or waiting for a core)."""
    busy_s: float
    """CPU seconds, over all cores, spent neither idle nor waiting for I/O, since boot."""
    steal_s: float
    """CPU seconds stolen by the hypervisor, since boot (0 where the system does not count them)."""
    total_s: float
    """All CPU seconds, since boot."""


def read_cpu() -> CpuSample:
    """The node now: the load average and psutil's CPU times (guest time is already counted in user time)."""
    t = psutil.cpu_times()
    parts = t._asdict()
    total = sum(v for k, v in parts.items() if k not in ("guest", "guest_nice"))
    idle = parts.get("idle", 0.0) + parts.get("iowait", 0.0)
    return CpuSample(time.monotonic(), os.getloadavg()[0], total - idle, parts.get("steal", 0.0), total)


@dataclass(frozen=True)
class PointLoad:
    """How busy the node was around one point (its `load` in bench.json)."""

    load_before: float
    """1-minute load average as the point started."""
    load_after: float
    """1-minute load average as it ended."""
    busy_cores_before: float
    """Cores other programs kept busy in the WINDOW_S seconds before the point."""
    steal_before: float
    """Share of the CPU time stolen in that window."""
    steal: float
    """Share of the CPU time stolen during the point."""
    warnings: list[str] = field(default_factory=list)
    """Why the point's figures are doubtful; empty when they are not."""


def assess(start: CpuSample, before: CpuSample, after: CpuSample, threads: int, cores: int) -> PointLoad:
    """The load around a point from samples at the start of the window before it, as it started and as it ended.
    `threads`: the point's processes on this node × threads per rank; `cores`: the node's."""
    busy = _rate(before.busy_s - start.busy_s, before.time - start.time)
    steal_before = _share(before.steal_s - start.steal_s, before.total_s - start.total_s)
    steal = _share(after.steal_s - before.steal_s, after.total_s - before.total_s)
    free = max(cores - threads, 0)
    warnings = []
    if busy > free + BUSY_MARGIN:
        warnings.append(
            f"other programs kept {busy:.1f} core(s) busy just before it, but it leaves {free} of the {cores} free "
            f"(its ranks run {threads} thread(s)): they shared cores"
        )
    if after.load > max(cores, threads) + LOAD_MARGIN:
        warnings.append(
            f"the 1-minute load average was {after.load:.2f} after it, on {cores} core(s): more tasks than cores "
            "wanted to run while it ran"
        )
    worst = max(steal, steal_before)
    if worst > STEAL_LIMIT:
        warnings.append(f"the hypervisor stole {worst:.0%} of the CPU time (steal) for other machines")
    return PointLoad(before.load, after.load, busy, steal_before, steal, warnings)


def watch_point(
    launch: Callable[[], int],
    threads: int,
    cores: int,
    sampler: Callable[[], CpuSample] = read_cpu,
    window_s: float = WINDOW_S,
) -> tuple[int, PointLoad]:
    """Run `launch` (one point) between samples of the node; its exit code and the load around it."""
    start = sampler()
    time.sleep(window_s)
    before = sampler()
    code = launch()
    return code, assess(start, before, sampler(), threads, cores)


def _rate(seconds: float, elapsed: float) -> float:
    return max(seconds, 0.0) / elapsed if elapsed > 0 else 0.0


def _share(part: float, whole: float) -> float:
    return max(part, 0.0) / whole if whole > 0 else 0.0
