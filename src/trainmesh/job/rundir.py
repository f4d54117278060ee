"""A run folder's whole life, `<run.out_dir>/<run.id>/`, in one object, `RunFolder`: its name (a new run, a named
one, or the run to resume), one job's hold on it (the launcher's lock and every worker's: locks.py), the config a
launch hands its workers (written, or matched by a node that joins), whether it holds checkpoints to resume, and
the run's config.toml with its history. `config_identity` says once what "the same config" means.

The launcher (before any process starts) or, without it (plain torchrun, srun, python), rank 0 of the job creates
the folder and takes its lock; only rank 0 of a job writes into it afterwards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import difflib
import os
import re
import socket
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.config import Config, dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.core.files import make_dirs, make_new_dir, read_bytes, write_atomically
from trainmesh.core.logging import get_logger
from trainmesh.job.locks import RunFolderError, RunLock, hold_as_worker
from trainmesh.launch.options import LaunchError

if TYPE_CHECKING:
    from trainmesh.job.spec import Job

log = get_logger(__name__)

CONFIG_FILE = "config.toml"
LAUNCH_CONFIG_FILE = ".config.launch.toml"
CONFIG_HISTORY_DIR = "config_history"
MAX_CONFIG_BYTES = 4 * 2**20  # a config.toml is a few KiB: a larger file is not one
DECIDED_BY_EACH_LAUNCH = ("checkpoint.resume",)
"""Recorded keys that describe one launch, not the run: never carried over, compared, or reported as a change."""
SAME_CONFIG_FIX = "Fix: launch every node with the same --config and overrides."


def config_identity(config: Config | str) -> dict[str, Any] | str:
    """What makes two configs one run's, which every node and rank of a job must share: the config (or a config
    file's text) without what each launch decides for itself (DECIDED_BY_EACH_LAUNCH). Text that is not TOML is
    its own identity."""
    text = config if isinstance(config, str) else dump_toml(config_to_dict(config))
    try:
        data = tomllib.loads(text)
    except (tomllib.TOMLDecodeError, RecursionError):
        return text
    for key in DECIDED_BY_EACH_LAUNCH:
        *sections, leaf = key.split(".")
        table: Any = data
        for name in sections:
            table = table.get(name) if isinstance(table, dict) else None
        if isinstance(table, dict):
            table.pop(leaf, None)
    return data


class RunFolder:
    """One run folder and one job's hold on it: `with folder:` takes the job's lock, or joins the lock of another
    node of the same job (`job_id`)."""

    def __init__(self, path: Path, job_id: str | None = None) -> None:
        self.path = path
        self.job_id = job_id or _new_job_id()
        """The job holding the folder: the nodes of one job share it, and its workers get it (--job) to join."""
        self._lock = RunLock(path, self.job_id)
        self._workers: IO[Any] | None = None

    @property
    def name(self) -> str:
        return self.path.name

    # Which folder: a new one, a named one (created when missing), or the existing one of the run to resume.

    @classmethod
    def new(cls, out_dir: Path, recipe: str, job_id: str | None = None) -> RunFolder:
        """A new folder `<recipe>-<date>-<time>` (then `-2`, `-3`, ...: launches within one second never share
        one), created here, so that no other launch can take the same name."""
        base = f"{recipe}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            path = make_new_dir(out_dir, base, limit=9999)
        except OSError as e:
            raise _unwritable(out_dir, e) from None
        if path is None:
            raise RunFolderError(f"{out_dir} already holds 9999 runs named {base}-*. Fix: name this run with --run-id.")
        return cls(path, job_id)

    @classmethod
    def named(cls, out_dir: Path, name: str, job_id: str | None = None) -> RunFolder:
        """`out_dir/name`, created if missing (an existing run folder is reused: --resume)."""
        path = out_dir / name
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise _unwritable(out_dir, e) from None
        return cls(path, job_id)

    @classmethod
    def existing(cls, out_dir: Path, name: str, job_id: str | None = None) -> RunFolder:
        """The folder of the run to resume; a name with no folder (a misspelled --run-id) is refused."""
        if not name:
            raise RunFolderError(
                "--resume needs the run to continue: add --run-id NAME (its folder under run.out_dir), "
                "or leave out --resume to start a new run"
            )
        path = out_dir / name
        if path.is_dir():
            return cls(path, job_id)
        runs = [p for p in out_dir.iterdir() if p.is_dir()] if out_dir.is_dir() else []
        runs.sort(key=lambda p: p.stat().st_mtime, reverse=True)
        close = difflib.get_close_matches(name, [p.name for p in runs], n=1)
        listing = f" Runs there, newest first: {', '.join(p.name for p in runs[:5])}." if runs else ""
        raise RunFolderError(
            f"--resume: there is no run folder {path} (nothing to resume).{listing}"
            + (f" Did you mean --run-id {close[0]}?" if close else "")
            + " Fix: --run-id with the name of an existing run, or leave out --resume to start a new run."
        )

    @classmethod
    def take(cls, out_dir: Path, run_id: str, recipe: str, *, resume: bool, job_id: str | None = None) -> RunFolder:
        """The folder a launch (or rank 0 without one) runs in: the existing one of the run to `resume` (a misspelled
        name is refused), the one `run_id` names (created if missing), or a new one claimed here."""
        if resume:
            return cls.existing(out_dir, run_id, job_id)
        if run_id:
            return cls.named(out_dir, run_id, job_id)
        return cls.new(out_dir, recipe, job_id)

    @staticmethod
    def shared_name(prefix: str, suffix: str) -> str:
        """The name the nodes of a multi-node job agree on, from what they share (`opts.default_run_suffix()`)."""
        return f"{prefix}-{re.sub(r'[^A-Za-z0-9._-]', '-', suffix)}"

    @staticmethod
    def check_auto_resume(auto_resume: bool, resume: bool, run_id: str) -> bool:
        """--auto-resume continues a run by its name (its folder created when missing): it needs the name, and
        --resume (which refuses a missing folder) contradicts it. Returns `auto_resume`."""
        if auto_resume and resume:
            raise RunFolderError(
                "--resume and --auto-resume both given: --resume refuses a run folder that does not exist, "
                "--auto-resume creates it. Fix: keep one (--auto-resume for a command a scheduler reruns)."
            )
        if auto_resume and not run_id:
            raise RunFolderError(
                "--auto-resume needs the run's name, the same on every attempt: add --run-id NAME (python -m "
                "trainmesh: --run.id=NAME), e.g. gpt-$SLURM_JOB_ID."
            )
        return auto_resume

    # Whether a launch resumes: what the folder holds.

    def has_checkpoints(self) -> bool:
        return bool(list_checkpoints(self.path))

    def resumed_if_checkpointed(self, config: Config) -> Config:
        """`config`, set to resume when this folder holds a checkpoint (a run under --auto-resume, or one restarted
        after it saved); else `config` itself."""
        if config.checkpoint.resume or not self.has_checkpoints():
            return config
        return dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, resume=True))

    def refuse_other_runs_checkpoints(self, resume: bool, resume_hint: str | None = None) -> None:
        """A new run (not resuming) must start in a folder without checkpoints: they would collide with its own."""
        found = [] if resume else list_checkpoints(self.path)
        if found:
            again = resume_hint or "set checkpoint.resume = true (--resume on the command line)"
            raise LaunchError(
                f"{self.path} already holds checkpoints (newest: {found[-1].name}); a new run there would collide "
                f"with them. Continue that run with: {again}\nOr start a new run under another --run-id."
            )

    # One job's hold: the lock (see locks.py), and every worker's.

    @property
    def joined(self) -> bool:
        """Another node of this job holds the lock (it also writes the run's config)."""
        return self._lock.joined

    def lock(self) -> None:
        """Take the job's lock, or join another node's of this job; RunFolderError, naming the holder, when another
        job holds it or its workers still run."""
        self._lock.acquire()

    def hold_as_worker(self) -> None:
        """Every worker holds the folder until its process ends or `release`: a new launch cannot take it from
        workers whose launcher died."""
        self._workers = hold_as_worker(self.path)

    def release(self) -> None:
        self._lock.release()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> RunFolder:
        self.lock()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextlib.contextmanager
    def held_for(self, job: Job, resume_hint: str | None = None) -> Iterator[Path]:
        """A launcher's hold while its workers run: the lock (which the workers' rank 0 joins with `job_id`), no
        checkpoints of another run here, and the job's config written for its workers (or, on a node that joins,
        matched); yields that file's path. The run's config.toml is the workers' to replace once they have loaded
        its checkpoint (`commit_config`): a launch that fails before leaves it as it was."""
        with self:
            self.refuse_other_runs_checkpoints(job.resume, resume_hint)
            if self.joined:
                path = self.match_launch_config(job.config)
            else:
                path = self.write_launch_config(job.config)
                self.record_new_run(job.config)
            # The file stays when this launch ends: the workers of nodes that joined it may restart and read it.
            yield path

    # The config: the one a launch hands its workers, and the run's own, config.toml, with its history.

    def write_launch_config(self, config: Config) -> Path:
        """`<run>/.config.launch.toml`, its first line naming the launch (for the nodes that join it): config.toml
        itself is replaced only once the workers have taken the folder over and loaded its checkpoint."""
        path = self.path / LAUNCH_CONFIG_FILE
        write_atomically(path, _launch_line(self.job_id) + dump_toml(config_to_dict(config)))
        return path

    def match_launch_config(self, config: Config) -> Path:
        """On a node that joins another's launch (sharing the folder): check that its config is the one the node
        holding the lock wrote (waiting for it), instead of overwriting that under running workers. A node
        restarted later may differ in checkpoint.resume (it finds checkpoints the first start had not made yet):
        the workers agree on resuming among themselves."""
        path = self.path / LAUNCH_CONFIG_FILE
        deadline = time.monotonic() + 30
        while not (written := self._launch_config_text()) and time.monotonic() < deadline:
            time.sleep(0.2)  # the node holding the lock writes it first
        ours = config_identity(config)
        assert isinstance(ours, dict)  # a config's own TOML always reads
        if config_identity(written) != ours:
            theirs = written.splitlines()
            diff = [line for line in dump_toml(ours).splitlines() if line not in theirs][:5]
            raise LaunchError(
                f"another node of this job wrote {path} with a different config (this node has: {'; '.join(diff)}). "
                + SAME_CONFIG_FIX
            )
        return path

    def _launch_config_text(self) -> str:
        """This launch's config file: an earlier launch's may still be there (a requeued job's)."""
        try:
            text = read_bytes(self.path / LAUNCH_CONFIG_FILE, MAX_CONFIG_BYTES).decode(errors="replace")
        except (OSError, ValueError):
            return ""
        return text if text.startswith(_launch_line(self.job_id)) else ""

    def record_new_run(self, config: Config) -> None:
        """`config` as the run's config.toml when the folder has none yet and no checkpoint (a new run): its record
        from the start, so that a run stopped before its first checkpoint resumes with its own settings. An existing
        one is left for `commit_config` (a symlink planted there too: that replaces it, never writing through it)."""
        path = self.path / CONFIG_FILE
        if not (path.exists() or path.is_symlink() or self.has_checkpoints()):  # a resume's is the checkpoint's
            write_atomically(path, dump_toml(config_to_dict(config)))

    def commit_config(self, config: Config, step: int) -> Path:
        """Make `config` the run's config.toml, once the job has taken the folder over and starts at `step` (its
        checkpoint loaded, or 0). A recorded config of another identity is kept first, as
        `config_history/step_<step>.toml`: what the run trained with up to that step."""
        path = self.path / CONFIG_FILE
        text = dump_toml(config_to_dict(config))
        try:
            before: bytes | None = read_bytes(path, MAX_CONFIG_BYTES)
        except FileNotFoundError:
            before = None
        except (OSError, ValueError) as e:  # a planted symlink (never read through), or not a config: replaced
            log.warning("%s is replaced without keeping it (%s)", path, e)
            before = None
        if before is not None and config_identity(before.decode(errors="replace")) != config_identity(text):
            self._keep_in_history(before, step)
        write_atomically(path, text)
        return path

    def _keep_in_history(self, recorded: bytes, step: int) -> None:
        history = make_dirs(self.path, CONFIG_HISTORY_DIR)
        kept, n = history / f"step_{step:08d}.toml", 1
        while kept.exists() or kept.is_symlink():  # resumed from this step before, with another change
            n += 1
            kept = history / f"step_{step:08d}-{n}.toml"
        write_atomically(kept, recorded)
        log.info("the run's config changed at step %d; the one before is kept in %s", step, kept)


def _new_job_id() -> str:
    """A job id no other launch has: host, pid and time."""
    return f"{socket.gethostname()}-{os.getpid()}-{dt.datetime.now().strftime('%Y%m%d%H%M%S%f')}"


def _launch_line(job_id: str) -> str:
    """The first line of a launch's config file: a TOML comment naming the launch."""
    return f"# launch {job_id}\n"


def _unwritable(out_dir: Path, error: OSError) -> RunFolderError:
    return RunFolderError(
        f"cannot create the run folder under run.out_dir={str(out_dir)!r}: {error.strerror} ({error.filename}). "
        "Fix: --run.out_dir=<a folder you can write to>.",
    )
