"""Stall watchdog: when no training step completes within `dist.stall_timeout_s`, write every rank's stacks and a
report naming the silent ranks, and end the attempt, so that torchrun can restart the group instead of burning hours.

Details: docs/internals.md#trainwatchdogpy
"""

from __future__ import annotations

import contextlib
import datetime as dt
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import FrameType
from typing import IO

import torch.distributed as dist

from trainmesh.core.env import restart_count
from trainmesh.core.errors import EXIT_STALLED
from trainmesh.core.files import make_dirs, open_file, write_atomically
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

STALLS_DIR = "stalls"
# Frames of these files mean "waiting for the other ranks": a collective, or a backward whose gradient
# all-reduce (DDP) waits for them.
_WAITING_IN = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/", "trainmesh/runtime/")


@dataclass
class Heartbeat:
    rank: int
    step: int
    idle_s: float
    """Seconds since this rank's last beat, when it published."""
    published: float
    """time.time() of publication; a stale one means the rank no longer runs Python."""
    host: str
    pid: int
    started: int
    """The process's start time (clock ticks after boot, from /proc): with the pid, names the process."""
    where: str
    """The main thread's innermost frame, and the innermost one in trainmesh or user code."""
    waiting: bool
    """The main thread is inside a collective or a backward (i.e. it arrived and waits for others)."""


class StallWatchdog:
    """Context manager; a no-op when `timeout_s` is 0."""

    def __init__(
        self,
        run_dir: Path,
        timeout_s: float,
        rank: int,
        world_size: int,
        store: dist.Store | None,
        label: str = "attempt_0",
    ) -> None:
        """`label`: this attempt's folder under `<run>/stalls` (`attempt_label()`, the same on every rank)."""
        self.timeout_s, self.rank, self.world_size, self.store = timeout_s, rank, world_size, store
        self.run_dir, self.label = run_dir, label
        self.dir = run_dir / STALLS_DIR / label
        self.interval = min(max(timeout_s / 10, 0.1), 5.0)
        self.grace = max(3 * self.interval, 1.0)  # the Python thread acts first when it can run
        self._step = 0
        self._last_beat: float | None = None  # armed by the first beat, so compilation is not a stall
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="trainmesh-stall-watchdog", daemon=True)
        # The thread that trains is the one that makes the watchdog: the main thread, except under Ray Train,
        # which runs the training function in a thread of its own.
        self._main_ident = threading.get_ident()
        self._stacks: IO[str] | None = None

    @classmethod
    def off(cls) -> StallWatchdog:
        return cls(Path("."), 0, 0, 1, None)

    def beat(self, step: int) -> None:
        if self._last_beat is None and self._stacks is not None:
            # The first beat arms faulthandler's timer (the thread re-arms it from then on), so that a
            # rank that holds the GIL before the thread's next tick is still dumped.
            faulthandler.dump_traceback_later(self.timeout_s + self.grace, file=self._stacks, exit=True)
        self._step, self._last_beat = step, time.monotonic()

    def __enter__(self) -> StallWatchdog:
        if self.timeout_s > 0:
            make_dirs(self.run_dir, STALLS_DIR, self.label)
            # Opened now: faulthandler's timer needs a file descriptor in advance.
            self._stacks = open_file(self.dir / f"rank_{self.rank}.txt", "w")
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._stacks is None:
            return
        self._stop.set()
        self._thread.join()
        faulthandler.cancel_dump_traceback_later()
        self._stacks.close()
        # Nothing stalled: leave no empty files behind (the folders go when the last rank leaves them).
        # Someone may have removed them already: that is no reason to fail a finished run.
        path = self.dir / f"rank_{self.rank}.txt"
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_size == 0:
                path.unlink()
        for folder in (self.dir, self.dir.parent):
            try:
                folder.rmdir()
            except FileNotFoundError:
                continue
            except OSError:  # not empty: another rank's file, or a report
                break

    def _watch(self) -> None:
        armed_for: float | None = None
        while not self._stop.wait(self.interval):
            last = self._last_beat
            idle = 0.0 if last is None else time.monotonic() - last
            self._publish(idle)  # from the start, so that peers know this rank's pid and host
            if last is None:
                continue
            if idle > self.timeout_s:
                self._stalled(idle)
            if armed_for != last:  # progress since the timer was armed: arm it anew from that beat
                assert self._stacks is not None
                faulthandler.dump_traceback_later(self.timeout_s + self.grace - idle, file=self._stacks, exit=True)
                armed_for = last

    def _publish(self, idle: float) -> None:
        if self.store is None:
            return
        try:
            self.store.set(f"rank_{self.rank}", json.dumps(asdict(self._heartbeat(idle))))
        except (RuntimeError, OSError) as e:  # the store's host is gone: the job is ending anyway
            log.debug("heartbeat not published: %s", e)

    def _heartbeat(self, idle: float) -> Heartbeat:
        where, waiting = _main_thread_location(sys._current_frames().get(self._main_ident or 0))
        host, pid = socket.gethostname(), os.getpid()
        return Heartbeat(self.rank, self._step, idle, time.time(), host, pid, _start_time(pid) or 0, where, waiting)

    def _stalled(self, idle: float) -> None:
        faulthandler.cancel_dump_traceback_later()
        assert self._stacks is not None
        self._stacks.write(f"rank {self.rank}: no step completed for {idle:.1f} s after step {self._step}\n")
        self._stacks.flush()
        faulthandler.dump_traceback(self._stacks, all_threads=True)
        self._stacks.flush()
        try:
            if self.store is None or self.store.add("reporters", 1) == 1:  # the first rank here reports
                beats = self._heartbeats()
                report = self.report(idle, beats)
                write_atomically(self.dir / "report.txt", report + "\n")
                log.error("%s", report)
                self._await_peer_dumps()
                self._kill_silent_neighbours(beats)
            else:
                log.error("rank %d: no step for %.1f s; stacks in %s", self.rank, idle, self.dir)
                self._await_peer_dumps()
        except (RuntimeError, OSError) as e:  # whatever fails here, the process must still leave
            log.error("rank %d: stalled, and the stall report failed: %s", self.rank, e)
        for handler in logging.getLogger("trainmesh").handlers:
            handler.flush()
        os._exit(EXIT_STALLED)

    def _await_peer_dumps(self) -> None:
        """Leave only once the other ranks have written their stacks (torchrun stops everybody as soon
        as one worker exits), or after the grace in which faulthandler's timer dumps a rank that holds
        the GIL; never longer."""
        if self.store is None:
            return
        dumped = self.store.add("dumped", 1)
        deadline = time.monotonic() + self.grace + 1.0
        while dumped < self.world_size and time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            dumped = self.store.add("dumped", 0)

    def _is_silent(self, beat: Heartbeat) -> bool:
        """No heartbeat for a while: the process runs no Python at all (stopped, or the GIL is held)."""
        return time.time() - beat.published > max(3 * self.interval, 1.0)

    def _kill_silent_neighbours(self, beats: dict[int, Heartbeat]) -> None:
        """SIGKILL silent ranks on this host. torchrun would too, but only after its 30 s grace for
        SIGTERM, which a stopped process or one holding the GIL never acts on."""
        host = socket.gethostname()
        for rank, beat in beats.items():
            if beat.host != host or beat.pid == os.getpid() or not self._is_silent(beat):
                continue
            if not is_fellow_worker(beat.pid, beat.started):
                log.error(
                    "rank %d's heartbeat names pid %d, which is no worker of this job: not killing it", rank, beat.pid
                )
                continue
            log.error("rank %d (pid %d) is silent: killing it so that the group can restart", rank, beat.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(beat.pid, signal.SIGKILL)

    def report(self, idle: float, beats: dict[int, Heartbeat]) -> str:
        """What every rank was doing, and which ranks did not arrive."""
        newest = max((b.step for b in beats.values()), default=self._step)
        now = time.time()
        lines = [
            f"STALL: rank {self.rank} completed no step for {idle:.1f} s (dist.stall_timeout_s={self.timeout_s:g}) "
            f"after step {self._step}.",
        ]
        missing = []
        for rank in range(self.world_size):
            beat = beats.get(rank)
            if beat is None:
                lines.append(f"  rank {rank}: no heartbeat at all")
                missing.append(rank)
                continue
            state = f"step {beat.step}, {beat.host} pid {beat.pid}"
            if self._is_silent(beat):
                silent = now - beat.published
                lines.append(
                    f"  rank {rank}: {state}: SILENT for {silent:.1f} s: stopped (e.g. SIGSTOP), or stuck in a "
                    f"call that holds the GIL; last seen at {beat.where}"
                )
                missing.append(rank)
            elif beat.step < newest or not beat.waiting:
                lines.append(f"  rank {rank}: {state}: NOT WAITING for peers; at {beat.where}")
                missing.append(rank)
            else:
                lines.append(f"  rank {rank}: {state}: waiting for peers at {beat.where}")
        if missing:
            lines.append(f"Did not arrive: rank(s) {', '.join(map(str, missing))}.")
        else:
            lines.append("Every rank waits in a collective: a mismatch? Rerun with --dist.debug=detail.")
        lines.append(f"Python stacks of every rank: {self.dir}/rank_<r>.txt")
        return "\n".join(lines)

    def _heartbeats(self) -> dict[int, Heartbeat]:
        if self.store is None:
            return {self.rank: self._heartbeat(0.0)}
        keys = [f"rank_{r}" for r in range(self.world_size)]
        beats = {}
        for rank, key in enumerate(keys):
            if self.store.check([key]):
                with contextlib.suppress(TypeError, ValueError):  # the store is open to local users: check
                    beats[rank] = _checked(Heartbeat(**json.loads(self.store.get(key))))
        return beats


def _checked(beat: Heartbeat) -> Heartbeat:
    """A heartbeat whose fields have their types (ValueError otherwise)."""
    kinds: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float), "str": str, "bool": bool}
    for f in fields(Heartbeat):
        if not isinstance(getattr(beat, f.name), kinds[str(f.type)]):
            raise ValueError(f"heartbeat field {f.name}")
    return beat


def attempt_label() -> str:
    """This attempt's folder name under `<run>/stalls`: when it started, and torchrun's restart count."""
    restart = str(restart_count())
    return f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-attempt_{restart}"


def is_fellow_worker(pid: int, started: int) -> bool:
    """Whether `pid` is a process started by the same parent as this one (a worker of the same torchrun
    agent) at the time `started` says, so not another user's process or a later one that reused the pid.
    The rendezvous store has no authentication, so nothing read from it is acted on unchecked."""
    parent, stat = os.getppid(), _stat(pid)
    if parent <= 1:  # the agent is gone: "the same parent" would match any orphan of the machine
        return False
    return stat is not None and stat[0] == parent and stat[1] == started and started > 0


def _start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[1]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks after boot) of `pid`, from /proc (None: unknown)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # the name may hold spaces
        return int(fields[1]), int(fields[19])  # fields 4 and 22 of proc(5), counted after the name
    except (OSError, IndexError, ValueError):
        return None


def _main_thread_location(frame: FrameType | None) -> tuple[str, bool]:
    """('innermost frame [<- innermost frame of ours]', whether it waits for peers)."""
    if frame is None:
        return "unknown", False
    stack = []
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    files = [f.f_code.co_filename.replace(os.sep, "/") for f in stack]
    waiting = any(marker in files[0] for marker in _WAITING_IN)
    described = _describe(stack[0])
    ours = next((f for f, name in zip(stack, files, strict=True) if not _is_library(name)), None)
    if ours is not None and ours is not stack[0]:
        described += f" <- {_describe(ours)}"
    return described, waiting


def _is_library(filename: str) -> bool:
    return "/torch/" in filename or "trainmesh/runtime/" in filename


def _describe(frame: FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
