"""What this machine has: its memory and the CPUs this process may use."""

from __future__ import annotations

import os
from pathlib import Path


def host_memory() -> float:
    """Bytes of memory this machine has (Linux's MemTotal; elsewhere the physical pages)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a scheduler's cgroup narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
