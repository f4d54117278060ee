"""Workers never outlive their launcher (core/orphans.py): the launcher SIGKILLed by pid from outside, as the
kernel's out-of-memory killer or a lost node agent would end it, takes every worker and DataLoader process with
it within seconds, and no checkpoint is started after it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from support import descendants, nano_toml
from trainmesh.core.orphans import launcher_of

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _checkpoint_entries(run_dir: Path) -> set[str]:
    root = run_dir / "checkpoints"
    return {p.name for p in root.iterdir()} if root.is_dir() else set()


def test_a_killed_launcher_takes_its_workers_and_their_loader_workers_with_it(tmp_path: Path) -> None:
    command = [
        str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2",
        "--run-id", "orphans", "--", "--train.max_steps=1000000", "--checkpoint.every=3",
        "--data.num_workers=1",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    launcher = subprocess.Popen(command, cwd=tmp_path, env=env, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        run_dir = tmp_path / "runs" / "orphans"
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and len(_checkpoint_entries(run_dir)) < 3:
            time.sleep(0.2)  # training, and saving, well under way
        workers = [pid for pid in descendants(launcher.pid) if pid != launcher.pid]
        assert len(workers) >= 2, workers  # the ranks (their loader workers come and go with each epoch)
        os.kill(launcher.pid, signal.SIGKILL)  # by pid, from outside: no handler runs in the launcher
        launcher.wait()
        saved_by_then = _checkpoint_entries(run_dir)  # a save begun before the kill may still be renamed
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _alive(workers):
            time.sleep(0.2)
        assert not _alive(workers), f"still running 15 s after their launcher was killed: {_alive(workers)}"
        begun = {name.lstrip(".").removesuffix(".tmp") for name in saved_by_then}  # a staging folder's commit
        started_after = _checkpoint_entries(run_dir) - saved_by_then - begun
        assert not started_after, f"checkpoints started after the launcher was killed: {started_after}"
    finally:  # never leave a million-step run going on this machine
        for pid in _alive([*workers, *descendants(launcher.pid)]):
            os.kill(pid, signal.SIGKILL)


def test_which_launcher_started_a_worker_is_read_from_its_environment() -> None:
    assert launcher_of({"TORCHELASTIC_RUN_ID": "x", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"}) == "torchrun"
    assert launcher_of({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1"}) == "srun"
    assert launcher_of({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0"}) is None  # a shell in an allocation, no step
    assert launcher_of({"OMPI_COMM_WORLD_RANK": "0"}) == launcher_of({"PMI_RANK": "0"}) == "mpirun"
    assert launcher_of({"RANK": "0", "WORLD_SIZE": "1"}) is None  # set by hand: its parent is a shell


def test_the_watch_ends_a_process_whose_parent_died_and_its_children(tmp_path: Path) -> None:
    """The fallback for launchers whose forking thread may end before them (srun, mpirun): the parent-watch
    thread alone, with no parent-death signal, ends the orphan and its own child within a few seconds."""
    pids = tmp_path / "pids"
    orphan = textwrap.dedent(
        f"""
        import os, subprocess, sys, time
        from trainmesh.core.orphans import watch_parent
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        watch_parent(os.getppid(), interval_s=0.2)
        time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {orphan!r}]); time.sleep(600)",
        ]
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (pids.exists() and len(pids.read_text().split()) == 2):
        time.sleep(0.1)
    watched = [int(pid) for pid in pids.read_text().split()]
    assert _alive(watched) == watched
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _alive(watched):
        time.sleep(0.1)
    assert not _alive(watched)
