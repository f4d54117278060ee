"""Run folders from outside: names that escape, symlinks planted where trainmesh writes or reads, a second
job in the same folder, pids in the (unauthenticated) store, stall files removed under a finished run."""

from __future__ import annotations

import datetime as dt
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from support import nano_config, train_rank
from trainmesh.checkpoint.catalog import LATEST, make_checkpoint_root, write_latest
from trainmesh.cli import main
from trainmesh.core.files import UnsafePathError, make_dirs, open_file, write_atomically
from trainmesh.job import rundir
from trainmesh.job.locks import RunLock, hold_as_worker
from trainmesh.job.rundir import RunFolder, RunFolderError
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.testing import DistributedTestError, run_distributed
from trainmesh.train.watchdog import Heartbeat, StallWatchdog, is_fellow_worker


@pytest.mark.parametrize("name", ["../../x", "/etc/cron.d/x", "a/b", "two\nlines", ".hidden", "..", "x" * 129])
def test_run_ids_are_one_safe_path_component(name: str) -> None:
    with pytest.raises(ValueError, match="is not a run id: it must be one folder name"):
        load_config(None, [f"--run.id={name}"], "gpt")
    assert load_config(None, ["--run.id=gpt-exp1_v2.0"], "gpt").run.id == "gpt-exp1_v2.0"


def test_a_bad_run_id_or_a_missing_run_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "runs"
    (out / "gpt-baseline").mkdir(parents=True)
    flags = ["--nproc-per-node", "1", "--", f"--run.out_dir={out}"]
    assert main(["run", "gpt", "--run-id", "../../escaped", *flags]) == 2
    assert "is not a run id" in capsys.readouterr().err and not (tmp_path / "escaped").exists()
    assert main(["run", "gpt", "--resume", "--run-id", "gpt-baselin", *flags]) == 2
    err = capsys.readouterr().err
    assert "--resume: there is no run folder" in err and "Did you mean --run-id gpt-baseline?" in err
    assert main(["run", "gpt", "--resume", *flags]) == 2
    assert "--resume needs the run to continue: add --run-id NAME" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["gpt-baseline"]  # nothing created
    assert main(["run", "gpt", "--nproc-per-node", "1", "--", "--run.out_dir=/proc/no-runs-here"]) == 2
    assert "cannot create the run folder under run.out_dir='/proc/no-runs-here'" in capsys.readouterr().err
    assert main(["run", "gpt", "--nproc-per-node", "1", "--", "--optim.lr=inf"]) == 2
    assert "'optim.lr' must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "check"])
def test_launch_flags_that_cannot_work_are_refused_by_run_and_check_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """--nnodes 2 without a rendezvous address once left runs/gpt-None-None/ behind, and check said OK."""
    out = tmp_path / "runs"
    flags = ["--nnodes", "2", "--nproc-per-node", "1", "--", f"--run.out_dir={out}"]
    assert main([command, "gpt", *flags]) == 2
    assert "--nnodes=2 needs --master-addr and --master-port" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("command", "recipe"), [("run", "gpt"), ("check", "gpt"), ("run", "resnet")])
def test_a_data_source_that_does_not_exist_is_refused_before_launch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, recipe: str
) -> None:
    """It used to pass `check` and fail only inside the workers, after the launch."""
    out = tmp_path / "runs"
    flags = ["--nproc-per-node", "1", "--", f"--run.out_dir={out}", f"--data.source={tmp_path / 'nope'}"]
    assert main([command, recipe, *flags]) == 2
    assert f"data.source='{tmp_path / 'nope'}' does not exist on this machine" in capsys.readouterr().err
    assert not out.exists()


def test_default_names_are_unique_within_a_second(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Frozen(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> Frozen:
            return cls(2026, 11, 23, 5, 30, 0)

    monkeypatch.setattr(rundir.dt, "datetime", Frozen)
    made = [RunFolder.new(tmp_path, "gpt").path for _ in range(3)]  # three launches in the same second
    assert [p.name for p in made] == ["gpt-20261123-053000", "gpt-20261123-053000-2", "gpt-20261123-053000-3"]
    with pytest.raises(RunFolderError, match="nothing to resume"):
        RunFolder.existing(tmp_path, "gpt-none")


_HOLDER = """
import fcntl, json, os, socket, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate()
f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": "other", "since": "now"})); f.flush()
print("locked", flush=True)
time.sleep(600)
"""


def test_one_job_per_run_folder_and_a_dead_holders_lock_is_taken_over(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(
            RunFolderError, match=rf"in use by another job: pid {holder.pid} on host {socket.gethostname()}"
        ):
            RunLock(tmp_path, "mine").acquire()
        joined = RunLock(tmp_path, "other")  # another node of the same job: joins, does not hold
        joined.acquire()
        assert joined.joined and not joined.held
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # killed by pid: its lock dies with it, its file stays
        holder.wait()
    assert json.loads((tmp_path / ".lock").read_text())["pid"] == holder.pid
    with RunLock(tmp_path, "mine") as lock:
        assert lock.held and json.loads((tmp_path / ".lock").read_text())["pid"] == os.getpid()


_WORKER = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_SH)
print("working", flush=True)
time.sleep(600)
"""


def test_workers_that_outlive_their_launcher_keep_the_folder(tmp_path: Path) -> None:
    """The launcher was killed by pid, its workers still train: the folder's lock is free, theirs is not."""
    orphan = subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(tmp_path / ".lock.workers")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert orphan.stdout is not None and orphan.stdout.readline().strip() == "working"
        with pytest.raises(RunFolderError, match=r"processes of an earlier job still work in .*fuser -v"):
            RunLock(tmp_path, "mine").acquire()
        with (tmp_path / ".lock").open("a") as f:  # the refused launch let go of the folder's lock
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        orphan.kill()
        orphan.wait()
    with RunLock(tmp_path, "mine") as lock:
        shared = hold_as_worker(tmp_path)
        assert lock.held and shared is not None
        shared.close()


def test_a_launch_into_a_held_run_folder_changes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`trainmesh run` and a worker started without it (torchrun, srun) both refuse a folder another job
    holds, before writing anything into it."""
    run_dir = tmp_path / "runs" / "shared"
    run_dir.mkdir(parents=True)
    (run_dir / "config.toml").write_text("# the running job's config\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir / ".lock")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        flags = ["--nproc-per-node", "1", "--run-id", "shared", "--", f"--run.out_dir={run_dir.parent}"]
        assert main(["run", "gpt", *flags]) == 2
        assert f"is in use by another job: pid {holder.pid}" in capsys.readouterr().err
        with pytest.raises(DistributedTestError, match=f"in use by another job: pid {holder.pid}"):
            run_distributed(train_rank, 1, args=(str(tmp_path), ["--run.id=shared"]))
        assert (run_dir / "config.toml").read_text() == "# the running job's config\n"
        assert sorted(p.name for p in run_dir.iterdir()) == [".lock", "config.toml"]
    finally:
        holder.kill()
        holder.wait()


def _rank_with_its_own_lr(rank: int, root: str) -> None:
    config = nano_config(Path(root), f"--optim.lr={0.001 * (rank + 1)}", "--run.id=mixed")
    run_worker(config, Path(root) / "runs" / "mixed")


def test_ranks_started_with_different_configs_are_refused(tmp_path: Path) -> None:
    """The nodes of a job each read their own launcher's config: a job whose ranks disagree stops at once."""
    with pytest.raises(DistributedTestError, match=r"rank\(s\) \[1\] were started with another config than rank 0"):
        run_distributed(_rank_with_its_own_lr, 2, args=(str(tmp_path),))
    assert not (tmp_path / "runs" / "mixed").exists()


def test_planted_symlinks_are_never_written_or_read_through(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(UnsafePathError, match="metrics.jsonl is a symlink"):
        open_file(run / "metrics.jsonl", "a")
    (run / "config.toml").symlink_to(secret)
    write_atomically(run / "config.toml", "x = 1\n")  # replaces the link, not its target
    assert (run / "config.toml").read_text() == "x = 1\n" and not (run / "config.toml").is_symlink()
    (run / "stalls").symlink_to(tmp_path, target_is_directory=True)
    with pytest.raises(UnsafePathError, match="stalls is a symlink"):
        make_dirs(run, "stalls", "attempt_0")
    make_checkpoint_root(run)
    (run / "checkpoints" / LATEST).symlink_to(secret)
    write_latest(run, run / "checkpoints" / "step_00000001")
    assert (run / "checkpoints" / LATEST).read_text() == "step_00000001\n"
    assert secret.read_text() == "precious\n"


def test_a_run_never_writes_through_symlinks_planted_in_its_folder(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Links planted where a run writes whole files are replaced; one planted where it appends (metrics)
    stops the run before training, with what to fix. The files they point to are never touched. (And a
    --resume that finds no checkpoint says so loudly.)"""
    secret = tmp_path / "secret"
    secret.write_text("precious\n")
    run_dir = tmp_path / "runs" / "planted"
    run_dir.mkdir(parents=True)
    for name in ("loss.png", "config.toml"):
        (run_dir / name).symlink_to(secret)
    overrides = ["--run.id=planted", "--train.max_steps=2", "--checkpoint.resume=true"]
    run_distributed(train_rank, 1, args=(str(tmp_path), overrides))
    log = capfd.readouterr().err
    assert "checkpoint.resume: no valid checkpoint in" in log and "STARTING FROM STEP 0" in log
    assert secret.read_text() == "precious\n"
    assert not (run_dir / "loss.png").is_symlink() and (run_dir / "loss.png").read_bytes()[:4] == b"\x89PNG"
    assert not (run_dir / "config.toml").is_symlink()

    (run_dir / "metrics.jsonl").unlink()
    (run_dir / "metrics.jsonl").symlink_to(secret)
    with pytest.raises(DistributedTestError, match="metrics.jsonl is a symlink; trainmesh does not read or write"):
        run_distributed(train_rank, 1, args=(str(tmp_path), ["--run.id=planted", "--train.max_steps=4"]))
    assert secret.read_text() == "precious\n"


def test_a_finished_run_ignores_stall_files_removed_under_it(tmp_path: Path) -> None:
    watchdog = StallWatchdog(tmp_path, 30.0, 0, 1, None, "20260101-000000-attempt_0")
    with watchdog:
        watchdog.beat(1)
        for f in (tmp_path / "stalls").rglob("*"):
            if f.is_file():
                f.unlink()  # someone tidied up while the run was going
    assert not (tmp_path / "stalls").exists()


def test_a_later_launch_never_overwrites_an_earlier_stall_report(tmp_path: Path) -> None:
    """Each attempt reports into a folder of its own (named by when it started), so the stacks of a stall stay
    for the user to read after the run was relaunched."""
    first = StallWatchdog(tmp_path, 30.0, 0, 1, None, "20260101-000000-attempt_0")
    with first:
        assert first._stacks is not None
        first._stacks.write("the stacks of a stall\n")  # as _stalled writes them
    second = StallWatchdog(tmp_path, 30.0, 0, 1, None, "20260101-000500-attempt_0")  # the relaunch
    with second:
        second.beat(1)
    assert (tmp_path / "stalls" / "20260101-000000-attempt_0" / "rank_0.txt").read_text() == "the stacks of a stall\n"
    assert [p.name for p in (tmp_path / "stalls").iterdir()] == ["20260101-000000-attempt_0"]


def test_a_pid_from_the_store_is_killed_only_if_it_is_a_worker_of_this_job() -> None:
    stranger = subprocess.Popen(["sleep", "60"])  # our child: not a sibling under our parent
    try:
        started = int(Path(f"/proc/{stranger.pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert not is_fellow_worker(stranger.pid, started)
        mine = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        assert is_fellow_worker(os.getpid(), mine) and not is_fellow_worker(os.getpid(), mine + 1)  # pid reused
        watchdog = StallWatchdog(Path("/nonexistent"), 1.0, 0, 2, None)
        forged = Heartbeat(1, 0, 99.0, time.time() - 99, socket.gethostname(), stranger.pid, started, "?", False)
        watchdog._kill_silent_neighbours({1: forged})
        time.sleep(0.2)
        assert stranger.poll() is None, "a process that is not a worker of this job was killed"
    finally:
        stranger.kill()
        stranger.wait()


def test_torchrun_spellings_of_the_launch_flags_are_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "gpt", "--nproc_per_node", "3", "--standalone", "--max_restarts", "1"]) == 0
    assert "world size 3: OK" in capsys.readouterr().out
    multi = ["--standalone", "--nnodes", "2", "--master_addr", "127.0.0.1", "--master_port", "29500"]
    assert main(["check", "gpt", "--nproc_per_node", "1", *multi]) == 2
    assert "--standalone is for one node" in capsys.readouterr().err


def test_a_node_restarted_later_may_resume_where_the_first_start_did_not(tmp_path: Path) -> None:
    """The nodes of one job compare their configs, except checkpoint.resume: a pod restarted after checkpoints
    exist resumes (--auto-resume) while the config written by the first start says resume = false."""
    from trainmesh.job.spec import load_config, resolve
    from trainmesh.launch import LaunchError

    def job(*overrides: str) -> Any:
        return resolve(load_config(None, ["--model.size=nano", *overrides], "gpt"), 1)

    node = RunFolder(tmp_path, "j1")
    node.write_launch_config(job().config)  # the first start writes resume = false
    node.match_launch_config(job("--checkpoint.resume=true").config)
    with pytest.raises(LaunchError, match=r"different config \(this node has: lr = 0.001\)"):
        node.match_launch_config(job("--optim.lr=1e-3").config)


def test_a_joining_node_waits_for_its_own_launchs_config_not_an_earlier_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A requeued multi-node job repeats its launch id's parts, and the file of the launch before is still in the
    folder: a node that joins compares with its own launch's file, written by the node holding the lock."""
    import threading

    from trainmesh.job.spec import load_config, resolve

    def job(*overrides: str) -> Any:
        return resolve(load_config(None, ["--model.size=nano", *overrides], "gpt"), 1)

    RunFolder(tmp_path, "before").write_launch_config(job("--optim.lr=1e-3").config)  # the launch before
    writer = threading.Timer(0.5, lambda: RunFolder(tmp_path, "now").write_launch_config(job().config))
    writer.start()
    RunFolder(tmp_path, "now").match_launch_config(job().config)  # waits for "now", then matches
    writer.join()
