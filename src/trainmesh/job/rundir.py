"""Run folders: `<run.out_dir>/<run.id>/`, named once, held by one job at a time, holding the resolved config.

The launcher (before any process starts) or, without it (plain torchrun, srun, python), rank 0 of the
job creates the folder and takes its lock; only rank 0 of a job writes into it afterwards.

One job per folder: the lock is an exclusive `flock` on `<run>/.lock`, held for the job's lifetime. The
kernel releases it when its holder dies, so a lock left by a killed job is simply taken over; the file
names the holder (pid, host, job), for the message that refuses a second launch while the first is
alive. The workers hold a shared lock on `<run>/.lock.workers`, and a launch needs that one free as well,
so workers that outlive their launcher (killed by pid) still keep the folder theirs. The nodes of one
multi-node job share a job id: on a shared file system the first node's launcher holds the lock and the
others join it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import errno
import fcntl
import json
import os
import socket
import time
import tomllib
from pathlib import Path
from typing import IO, Any

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.config import Config, dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.core.errors import UserError
from trainmesh.core.files import make_dirs, make_new_dir, open_file, read_bytes, write_atomically
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

CONFIG_FILE = "config.toml"
LAUNCH_CONFIG_FILE = ".config.launch.toml"
CONFIG_HISTORY_DIR = "config_history"
MAX_CONFIG_BYTES = 4 * 2**20  # a config.toml is a few KiB: a larger file is not one
LOCK_FILE = ".lock"
WORKERS_LOCK_FILE = ".lock.workers"


class RunFolderError(UserError):
    """The run folder cannot be created or used (not writable, or held by another live job)."""


def new_job_id() -> str:
    """A job id no other launch has: host, pid and time."""
    return f"{socket.gethostname()}-{os.getpid()}-{dt.datetime.now().strftime('%Y%m%d%H%M%S%f')}"


def create_run_dir(out_dir: Path, name: str) -> Path:
    """`out_dir/name`, created if missing (an existing run folder is reused: --resume)."""
    run_dir = out_dir / name
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _unwritable(out_dir, e) from None
    return run_dir


def existing_run_dir(out_dir: Path, name: str) -> Path:
    """The folder of the run to resume; a name with no folder (a misspelled --run-id) is refused."""
    if not name:
        raise RunFolderError(
            "--resume needs the run to continue: add --run-id NAME (its folder under run.out_dir), "
            "or leave out --resume to start a new run"
        )
    run_dir = out_dir / name
    if run_dir.is_dir():
        return run_dir
    runs = [p for p in out_dir.iterdir() if p.is_dir()] if out_dir.is_dir() else []
    runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    close = difflib.get_close_matches(name, [p.name for p in runs], n=1)
    listing = f" Runs there, newest first: {', '.join(p.name for p in runs[:5])}." if runs else ""
    raise RunFolderError(
        f"--resume: there is no run folder {run_dir} (nothing to resume).{listing}"
        + (f" Did you mean --run-id {close[0]}?" if close else "")
        + " Fix: --run-id with the name of an existing run, or leave out --resume to start a new run."
    )


def check_auto_resume(auto_resume: bool, resume: bool, run_id: str) -> bool:
    """--auto-resume continues a run by its name (its folder created when missing): it needs the name, and
    --resume (which refuses a missing folder) contradicts it. Returns `auto_resume`."""
    if auto_resume and resume:
        raise RunFolderError(
            "--resume and --auto-resume both given: --resume refuses a run folder that does not exist, --auto-resume "
            "creates it. Fix: keep one (--auto-resume for a command a scheduler reruns)."
        )
    if auto_resume and not run_id:
        raise RunFolderError(
            "--auto-resume needs the run's name, the same on every attempt: add --run-id NAME (python -m trainmesh: "
            "--run.id=NAME), e.g. gpt-$SLURM_JOB_ID."
        )
    return auto_resume


def resumed_if_checkpointed(config: Config, run_dir: Path) -> Config:
    """`config`, set to resume when `run_dir` holds a checkpoint (a run under --auto-resume, or one restarted
    after it saved); else `config` itself."""
    if config.checkpoint.resume or not list_checkpoints(run_dir):
        return config
    return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=True))


def claim_new_run_dir(out_dir: Path, recipe: str) -> Path:
    """A new folder `<recipe>-<date>-<time>` (then `-2`, `-3`, ...: launches within one second never
    share one), created here, so that no other launch can take the same name."""
    base = f"{recipe}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        run_dir = make_new_dir(out_dir, base, limit=9999)
    except OSError as e:
        raise _unwritable(out_dir, e) from None
    if run_dir is None:
        raise RunFolderError(f"{out_dir} already holds 9999 runs named {base}-*. Fix: name this run with --run-id.")
    return run_dir


def take_run_dir(out_dir: Path, run_id: str, recipe: str, resume: bool) -> Path:
    """The folder a launch (or rank 0 without one) runs in: the existing one of the run to `resume` (a misspelled
    name is refused), the one `run_id` names (created if missing), or a new one claimed here."""
    if resume:
        return existing_run_dir(out_dir, run_id)
    if run_id:
        return create_run_dir(out_dir, run_id)
    return claim_new_run_dir(out_dir, recipe)


def _unwritable(out_dir: Path, error: OSError) -> RunFolderError:
    return RunFolderError(
        f"cannot create the run folder under run.out_dir={str(out_dir)!r}: {error.strerror} ({error.filename}). "
        "Fix: --run.out_dir=<a folder you can write to>.",
    )


def write_launch_config(run_dir: Path, config: Config, launch_id: str) -> Path:
    """The config a launch hands its workers, `<run>/.config.launch.toml`, its first line naming the launch (for
    the nodes that join it): `config.toml` itself is replaced only once the workers have taken the folder over
    and loaded its checkpoint (`commit_config`)."""
    path = run_dir / LAUNCH_CONFIG_FILE
    write_atomically(path, launch_line(launch_id) + dump_toml(config_to_dict(config)))
    return path


def launch_line(launch_id: str) -> str:
    """The first line of a launch's config file: a TOML comment naming the launch."""
    return f"# launch {launch_id}\n"


def record_new_run(run_dir: Path, config: Config) -> None:
    """`config` as the run's config.toml when the folder has none yet and no checkpoint (a new run): its record
    from the start, so that a run stopped before its first checkpoint resumes with its own settings. An existing
    one is left for `commit_config` (a symlink planted there too: that replaces it, never writing through it)."""
    path = run_dir / CONFIG_FILE
    if not (path.exists() or path.is_symlink() or list_checkpoints(run_dir)):  # a resume's is the checkpoint's
        write_atomically(path, dump_toml(config_to_dict(config)))


def commit_config(run_dir: Path, config: Config, step: int) -> Path:
    """Make `config` the run's `config.toml`, once the job has taken the folder over and starts at `step` (its
    checkpoint loaded, or 0). A recorded config that this one changes is kept first, as
    `config_history/step_<step>.toml`: what the run trained with up to that step."""
    path = run_dir / CONFIG_FILE
    text = dump_toml(config_to_dict(config))
    try:
        before: bytes | None = read_bytes(path, MAX_CONFIG_BYTES)
    except FileNotFoundError:
        before = None
    except (OSError, ValueError) as e:  # a planted symlink (never read through), or not a config: replaced
        log.warning("%s is replaced without keeping it (%s)", path, e)
        before = None
    if before is not None and _what_the_run_is(before.decode(errors="replace")) != _what_the_run_is(text):
        history = make_dirs(run_dir, CONFIG_HISTORY_DIR)
        kept, n = history / f"step_{step:08d}.toml", 1
        while kept.exists() or kept.is_symlink():  # resumed from this step before, with another change
            n += 1
            kept = history / f"step_{step:08d}-{n}.toml"
        write_atomically(kept, before)
        log.info("the run's config changed at step %d; the one before is kept in %s", step, kept)
    write_atomically(path, text)
    return path


def _what_the_run_is(config_toml: str) -> dict[str, Any] | str:
    """A recorded config without what each launch decides for itself (whether it resumed)."""
    try:
        data = tomllib.loads(config_toml)
    except (tomllib.TOMLDecodeError, RecursionError):
        return config_toml  # unreadable: kept in the history if replaced
    data.get("checkpoint", {}).pop("resume", None)
    return data


_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)  # a file system without flock


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
