"""Fault injection for tests — the one documented hook. `TRAINMESH_FAULT` names rank, step, kind and phase (several
faults separated by ';'); each fires once per run directory:

    TRAINMESH_FAULT="rank=1,step=37,kind=sigkill"

Details: docs/internals.md#trainfaultspy
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

from trainmesh.core.env import read_var
from trainmesh.core.files import make_dirs, open_file

ENV_VAR = "TRAINMESH_FAULT"
F = TypeVar("F", bound=Callable[..., Any])
KINDS = ("sigkill", "exception", "exit", "segfault", "sigstop", "hang", "sleep", "diskfull", "nan")
PHASES = ("step", "data", "checkpoint", "commit")
_FOREVER_S = 10**6


class InjectedFault(RuntimeError):
    """Raised by kind=exception."""


@dataclass(frozen=True)
class Fault:
    index: int
    rank: int
    step: int
    kind: str
    phase: str = "step"


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for index, part in enumerate(p for p in spec.split(";") if p.strip()):
        fields = dict(item.split("=", 1) for item in part.split(",") if "=" in item)
        try:
            fault = Fault(index, int(fields["rank"]), int(fields["step"]), fields["kind"], fields.get("phase", "step"))
        except (KeyError, ValueError):
            raise ValueError(f"{ENV_VAR}={spec!r}: each fault needs rank=<int>,step=<int>,kind=<kind>") from None
        if fault.kind not in KINDS or fault.phase not in PHASES:
            raise ValueError(f"{ENV_VAR}={spec!r}: kind is one of {KINDS}, phase one of {PHASES}")
        faults.append(fault)
    return faults


class FaultSchedule:
    """The faults planned for one rank, parsed once from TRAINMESH_FAULT when the worker starts; with none
    planned (the normal case) every method returns at once."""

    def __init__(self, faults: list[Fault], rank: int, run_dir: Path) -> None:
        self.faults = [f for f in faults if f.rank == rank]
        self.run_dir = run_dir

    @classmethod
    def from_environ(cls, rank: int, run_dir: Path) -> FaultSchedule:
        return cls(parse_faults(read_var(ENV_VAR)), rank, run_dir)

    @classmethod
    def none(cls) -> FaultSchedule:
        return cls([], 0, Path("."))

    def inject(self, step: int, phase: str) -> None:
        """Fire the fault planned for (step, phase) on this rank, once per run directory."""
        for fault in self._due(step, phase, nan=False):
            _fire(fault)

    def loss(self, loss_fn: F, step: int) -> F:
        """`loss_fn`, or one whose loss is NaN when a kind=nan fault is due at optimizer step `step`
        (counted from 1) on this rank."""
        if not self._due(step, "step", nan=True):
            return loss_fn

        def poisoned(*args: Any) -> Any:
            return loss_fn(*args) * float("nan")

        return cast(F, poisoned)

    def _due(self, step: int, phase: str, nan: bool) -> list[Fault]:
        due = []
        for fault in self.faults:
            if (fault.step, fault.phase) != (step, phase) or (fault.kind == "nan") != nan:
                continue
            marker = self.run_dir / ".faults" / str(fault.index)
            if marker.exists():
                continue  # fired in an earlier attempt
            make_dirs(self.run_dir, ".faults")
            open_file(marker, "a").close()
            due.append(fault)
        return due


def _fire(fault: Fault) -> None:
    if fault.kind == "exception":
        raise InjectedFault(f"injected fault: {fault}")
    if fault.kind == "diskfull":
        raise OSError(errno.ENOSPC, f"No space left on device (injected: {fault})")
    if fault.kind == "exit":
        os._exit(1)
    if fault.kind == "hang":
        ctypes.PyDLL(None).sleep(_FOREVER_S)  # a PyDLL call keeps the GIL for its whole duration
    if fault.kind == "sleep":
        time.sleep(_FOREVER_S)
    sig = {"sigkill": signal.SIGKILL, "segfault": signal.SIGSEGV, "sigstop": signal.SIGSTOP}[fault.kind]
    os.kill(os.getpid(), sig)
