"""The locks that keep one job per run folder (used by `RunFolder`, job/rundir.py).

The job's lock is an exclusive `flock` on `<run>/.lock`, held for the job's lifetime; the kernel releases it when
its holder dies, so a lock left by a killed job is simply taken over. The file names the holder (pid, host, job)
for the message that refuses a second launch. Workers hold a shared lock on `<run>/.lock.workers`, which a launch
needs free as well: workers that outlive their launcher still keep the folder theirs. The nodes of one
multi-node job share a job id: the first node's launcher holds the lock and the others join it.
"""

from __future__ import annotations

import datetime as dt
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any

from trainmesh.core.errors import UserError
from trainmesh.core.files import open_file
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

LOCK_FILE = ".lock"
WORKERS_LOCK_FILE = ".lock.workers"
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a file system without flock


class RunFolderError(UserError):
    """The run folder cannot be created or used (not writable, or held by another live job)."""


class RunLock:
    """The exclusive lock of one job on its run folder (see the module docstring). A context manager."""

    def __init__(self, run_dir: Path, job: str) -> None:
        self.run_dir, self.job = run_dir, job
        self.path = run_dir / LOCK_FILE
        self.joined = False
        """Another node of this job holds the lock (it also writes the run's config)."""
        self._file: IO[Any] | None = None

    @property
    def held(self) -> bool:
        """Whether this launch holds the lock (not: joined another node's, or no locks on this file system)."""
        return self._file is not None

    def acquire(self) -> None:
        """Take the lock, or join it when another node of this job holds it. Raises RunFolderError, naming
        the holder, when another job holds it or its workers still run."""
        try:
            lock_file = open_file(self.path, "a+")
        except OSError as e:
            raise RunFolderError(
                f"cannot create {self.path}: {e.strerror}. Fix: --run.out_dir=<a folder you can write to>."
            ) from None
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            lock_file.close()
            if e.errno in _NO_LOCKS:
                log.warning("%s: no file locks on this file system (%s); not guarding the run folder", self.path, e)
                return
            self._join_or_refuse()
            return
        self._file = lock_file
        try:
            _check_no_workers_left(self.run_dir)
        except RunFolderError:
            self.release()
            raise
        lock_file.seek(0)
        lock_file.truncate()
        record = {"pid": os.getpid(), "host": socket.gethostname(), "job": self.job, "since": _now()}
        lock_file.write(json.dumps(record) + "\n")
        lock_file.flush()

    def _join_or_refuse(self) -> None:
        """The lock is held: join it when its holder is another node of this job, else refuse, naming the holder."""
        holder = self.holder()
        deadline = time.monotonic() + 2
        while "job" not in holder and time.monotonic() < deadline:  # it has the lock, not yet written to it
            time.sleep(0.1)
            holder = self.holder()
        if holder.get("job") == self.job:
            self.joined = True  # another node of this very job took it first
            return
        raise RunFolderError(
            f"run folder {self.run_dir} is in use by another job: pid {holder.get('pid', '?')} on host "
            f"{holder.get('host', '?')} (started {holder.get('since', '?')}). Two jobs in one folder would "
            "overwrite each other's config and checkpoints. Fix: wait for it to end (or stop it), or give this "
            "run another --run-id."
        ) from None

    def holder(self) -> dict[str, Any]:
        """What the lock file says about its holder ({} if it says nothing readable)."""
        try:
            with open_file(self.path, "r") as f:
                record = json.loads(f.read(4096) or "{}")
        except (OSError, ValueError):
            return {}
        return record if isinstance(record, dict) else {}

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor releases the flock
            self._file = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold_as_worker(run_dir: Path) -> IO[Any] | None:
    """Every worker holds a shared lock on `<run>/.lock.workers` while it runs (until its process ends or
    the file is closed), so that a new launch cannot take the folder from workers whose launcher died."""
    path = run_dir / WORKERS_LOCK_FILE
    shared = open_file(path, "a+")
    deadline = time.monotonic() + 10
    while True:
        try:
            fcntl.flock(shared, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return shared
        except OSError as e:
            if e.errno in _NO_LOCKS:
                shared.close()
                return None
            if time.monotonic() > deadline:  # a launch checks it for a moment only; this is something else
                shared.close()
                raise RunFolderError(f"{path} is held exclusively by another process. Fix: another --run-id.") from None
            time.sleep(0.05)


def _check_no_workers_left(run_dir: Path) -> None:
    """Refuse a folder in which workers of an earlier job still run (their launcher was killed, say)."""
    path = run_dir / WORKERS_LOCK_FILE
    with open_file(path, "a+") as probe:
        try:
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when `probe` closes, at once
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return
            raise RunFolderError(
                f"processes of an earlier job still work in {run_dir} (their launcher is gone): they hold {path} "
                f"open (`fuser -v {path}` or `lsof {path}` lists them). Fix: stop them, or give this run another "
                "--run-id."
            ) from None


def _now() -> str:
    return dt.datetime.now().astimezone().isoformat(timespec="seconds")
