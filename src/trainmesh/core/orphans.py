"""A worker ends with its launcher: when the process that started it dies, the worker and its DataLoader processes stop
at once, without saving (`die_with_parent`, `watch_parent`).

Details: docs/internals.md#coreorphanspy
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping

import psutil

from trainmesh.core.env import current_vars
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

LAUNCHER_PID = "TRAINMESH_LAUNCHER_PID"
"""The pid of `trainmesh run`'s process (torchrun's agent), which it gives its workers: one that started after the
launcher had died would otherwise take its new parent (init) for its launcher."""
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
WATCH_INTERVAL_S = 1.0


def die_with_parent(parent: int) -> bool:
    """Have the kernel SIGKILL this process when its parent ends (Linux); `parent`: its pid as this process
    started, to catch a parent that ended before the signal was set. False where the kernel offers no such signal."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # it ended before the signal was set
        _end(parent)
    return True


def watch_parent(parent: int, interval_s: float = WATCH_INTERVAL_S) -> threading.Thread:
    """Check every `interval_s` whether this process's parent is still `parent`; once it is not, kill this
    process's children and this process (no checkpoint, no cleanup: the launcher that would report it is gone)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval_s)
        _end(parent)

    thread = threading.Thread(target=watch, name="trainmesh-parent-watch", daemon=True)
    thread.start()
    return thread


def end_with_launcher(environ: Mapping[str, str] | None = None) -> str | None:
    """What a worker applies to itself, by the launcher its environment names; returns that launcher. Nothing
    without one: started from a shell, a run left to go on under nohup must go on."""
    env = current_vars() if environ is None else environ
    launcher = launcher_of(env)
    if launcher is not None:
        given = env.get(LAUNCHER_PID, "") if launcher == "torchrun" else ""  # only trainmesh run's agent sets it
        parent = int(given) if given.isdigit() else os.getppid()
        if launcher == "torchrun":
            die_with_parent(parent)
        watch_parent(parent)
    return launcher


def launcher_of(environ: Mapping[str, str]) -> str | None:
    """torchrun (its agent, also `trainmesh run`'s), srun or mpirun, by the variables each sets for its processes."""
    if "TORCHELASTIC_RUN_ID" in environ:  # first: torchrun inside an srun step sets both
        return "torchrun"
    if "SLURM_STEP_ID" in environ and "SLURM_PROCID" in environ:
        return "srun"
    if any(key in environ for key in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        return "mpirun"
    return None


def _end(parent: int) -> None:
    log.error("the launcher (pid %d) is gone: this process stops now, without a checkpoint", parent)  # flushed
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process().children(recursive=True):  # DataLoader workers: theirs is a 5 s watch
            with contextlib.suppress(psutil.Error):
                child.kill()
    os.kill(os.getpid(), signal.SIGKILL)
