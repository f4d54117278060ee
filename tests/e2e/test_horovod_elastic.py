"""Horovod's elastic API on torchrun's elastic agent (docs/horovod.md, "hvd.elastic"), with an elastic script in the
style of Horovod's examples (tests/e2e/scripts/horovod_elastic.py: hvd.elastic.run over a TorchState, rank 0 saving
each commit). A worker killed by pid mid-epoch: torchrun restarts both, and the pair resumes from the last commit and
ends with the weights of a run never killed, bit for bit. Nodes joining and leaving (`--nnodes 1:2`): a second node
joins a lone one, whose worker restarts, and the two resume from its last commit at world size 2; then the second
node is killed (its agent and worker, by pid), and the first goes on alone from the last commit at world size 1."""

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

    def start(out: Path, *launch: str, args: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
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


def _output(out: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(out.glob("launch.*.log")))


def _finish(job: subprocess.Popen[bytes], out: Path) -> None:
    assert job.wait(timeout=150) == 0, _output(out)


def _wait_for(condition: Callable[[], bool], what: str, job: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + 90
    while not condition():
        assert job.poll() is None, f"the job ended before {what}:\n{_output(out)}"
        assert time.monotonic() < deadline, f"no {what} within 90 s:\n{_output(out)}"
        time.sleep(0.1)


def _history(out: Path) -> list[tuple[int, int, int]]:
    """(attempt, world size, epoch) of each commit the last checkpoint descends from."""
    return [tuple(entry) for entry in torch.load(out / "checkpoint.pt", weights_only=True)["history"]]


def test_a_worker_killed_by_pid_resumes_from_the_last_commit_and_matches_a_run_never_killed(tmp_path: Path) -> None:
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    with _jobs() as start:
        _finish(start(whole, "--nproc-per-node", "2", args=("5",)), whole)
        job = start(killed, "--nproc-per-node", "2", "--max-restarts", "1", args=("5", "--pause", "2"))
        # half way through the second epoch, both ranks waiting: rank 1 is killed there, after the first commit
        paused = [killed / "paused.0.2", killed / "paused.1.2"]
        _wait_for(lambda: all(p.exists() for p in paused), "both ranks' pause", job, killed)
        os.kill(int((killed / "pid.1.0").read_text()), signal.SIGKILL)
        (killed / "release").touch()
        _finish(job, killed)
    assert _history(killed) == [(0, 2, 1)] + [(1, 2, epoch) for epoch in range(2, 6)]  # restarted, from commit 1
    ours, theirs = (torch.load(d / "final.pt", weights_only=True) for d in (whole, killed))
    for name, value in ours.items():
        assert torch.equal(value, theirs[name]), (name, (value - theirs[name]).abs().max())


def test_a_node_joins_then_one_leaves_and_each_time_the_job_goes_on_from_the_last_commit(tmp_path: Path) -> None:
    out, endpoint = tmp_path / "job", f"127.0.0.1:{free_port()}"
    node = ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "hvd-elastic"]
    # A dead node's keep-alive lapses after 3 missed beats 1 s apart, and a round with its minimum of nodes waits
    # 2 s for more (tests/e2e/test_elastic.py says why)
    node += ["--max-restarts", "2", "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    # 6 epochs: alone, wait after the first's commit for the other node; with it, pause half way through the fourth
    args = ("6", "--hold", "1", "--pause", "4")
    with _jobs() as start:
        first = start(out, *node, args=args)
        _wait_for(lambda: (out / "checkpoint.pt").exists(), "the first commit, alone", first, out)
        second = start(out, *node, args=args)
        _wait_for(lambda: len(list(out.glob("paused.*.2"))) == 2, "both ranks' pause at world size 2", first, out)
        for pid in descendants(second.pid):  # the second node: its agent, then its worker
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        (out / "release").touch()
        _finish(first, out)
    history = _history(out)
    assert [(size, epoch) for _, size, epoch in history] == [(1, 1), (2, 2), (2, 3), (1, 4), (1, 5), (1, 6)], history
