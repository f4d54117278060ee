"""Horovod's elastic API on torchrun's elastic agent (docs/horovod.md, "hvd.elastic"), with an elastic script in the
style of Horovod's examples (tests/e2e/scripts/horovod_elastic.py: hvd.elastic.run over a TorchState, rank 0 saving
each commit). A worker killed by pid mid-epoch: torchrun restarts both, and the pair resumes from the last commit and
ends with the weights of a run never killed, bit for bit. A node joining (`--nnodes 1:2`): the first node's worker
restarts, and the two resume from its last commit at world size 2."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from support import descendants
from trainmesh.core.env import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TRAINMESH = Path(sys.executable).parent / "trainmesh"
SCRIPT = ROOT / "tests" / "e2e" / "scripts" / "horovod_elastic.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT / "src")}


@contextlib.contextmanager
def _jobs() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Starts `trainmesh run [launch flags] SCRIPT OUT args` (output in OUT/launch.<n>.log); ends what is left."""
    started: list[subprocess.Popen[bytes]] = []

    def start(out: Path, *launch: str, args: tuple[str, ...]) -> subprocess.Popen[bytes]:
        out.mkdir(exist_ok=True)
        with open(out / f"launch.{len(started)}.log", "wb") as log:
            command = [str(TRAINMESH), "run", *launch, str(SCRIPT), str(out), *args]
            started.append(subprocess.Popen(command, env=ENV, stdout=log, stderr=subprocess.STDOUT))
        return started[-1]

    try:
        yield start
    finally:
        for job in started:
            if job.poll() is None:  # the agent and its workers (each in a session of its own)
                for pid in descendants(job.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                job.wait()


def _finish(job: subprocess.Popen[bytes], out: Path) -> None:
    assert job.wait(timeout=150) == 0, "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("launch.*.log")))


def _wait_for(condition: Callable[[], bool], what: str, job: subprocess.Popen[bytes], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert job.poll() is None, f"the job ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def _history(out: Path) -> list[tuple[int, int, int]]:
    """(attempt, world size, epoch) of each commit the last checkpoint descends from."""
    return [tuple(entry) for entry in torch.load(out / "checkpoint.pt", weights_only=True)["history"]]


def test_a_worker_killed_by_pid_resumes_from_the_last_commit_and_matches_a_run_never_killed(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    with _jobs() as start:
        _finish(start(whole, "--nproc-per-node", "2", args=("5", "0")), whole)
        job = start(killed, "--nproc-per-node", "2", "--max-restarts", "1", args=("5", "2"))
        # in the second epoch's pause (half of it done since the first commit; rank 0 cannot commit without rank 1)
        _wait_for(lambda: (killed / "paused.1.0.2").exists(), "the second epoch's pause", job)
        os.kill(int((killed / "pid.1.0").read_text()), signal.SIGKILL)
        _finish(job, killed)
    assert _history(killed) == [(0, 2, 1)] + [(1, 2, epoch) for epoch in range(2, 6)]  # restarted, from commit 1
    ours, theirs = (torch.load(d / "final.pt", weights_only=True) for d in (whole, killed))
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), (name, (value - theirs[name]).abs().max())


def test_a_node_joining_restarts_the_worker_and_the_pair_resumes_from_its_last_commit(tmp_path: Path) -> None:
    out, endpoint = tmp_path / "job", f"127.0.0.1:{free_port()}"
    node = ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "hvd-elastic"]
    node += ["--max-restarts", "2", "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    args = ("6", "0", "2")  # 6 epochs; alone, wait after the second's commit for the other node
    with _jobs() as start:
        first = start(out, *node, args=args)
        _wait_for(lambda: (out / "checkpoint.pt").exists() and len(_history(out)) == 2, "two commits alone", first)
        second = start(out, *node, args=args)
        _finish(first, out)
        _finish(second, out)
    history = _history(out)
    assert [(size, epoch) for _, size, epoch in history] == [(1, 1), (1, 2), (2, 3), (2, 4), (2, 5), (2, 6)], history
