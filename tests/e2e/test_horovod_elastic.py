"""Horovod's elastic API on torchrun's elastic agent (docs/horovod.md, "hvd.elastic"), with an elastic script written
as Horovod's examples write one (tests/e2e/scripts/horovod_elastic.py: hvd.elastic.run over a TorchState, rank 0
saving each commit). A worker killed by pid mid-epoch: torchrun restarts both, and the pair resumes from the last
commit and ends with the weights of a run never killed, bit for bit. A node joining (`--nnodes 1:2`): the first
node's worker restarts, and the two resume from its last commit at world size 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
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


def _start(out: Path, *launch: str, epochs: int, pause: float) -> subprocess.Popen[str]:
    out.mkdir()
    command = [str(TRAINMESH), "run", *launch, str(SCRIPT), str(out), str(epochs), str(pause)]
    return subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(job: subprocess.Popen[str]) -> str:
    output = job.communicate(timeout=150)[0]
    assert job.returncode == 0, output[-4000:]
    return output


def _committed(out: Path) -> list[tuple[int, int, int]]:
    """(attempt, world size, epoch) of each commit rank 0 saved."""
    log = out / "epochs.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [(int(a), int(n), int(e)) for a, n, e in (line.split() for line in lines)]


def _wait_for(condition: object, what: str, job: subprocess.Popen[str], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert job.poll() is None, f"the job ended before {what}: {job.communicate()[0][-4000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def test_a_worker_killed_by_pid_resumes_from_the_last_commit_and_matches_a_run_never_killed(tmp_path: Path) -> None:
    epochs = 5
    _finish(_start(tmp_path / "whole", "--nproc-per-node", "2", epochs=epochs, pause=0))
    out = tmp_path / "killed"
    job = _start(out, "--nproc-per-node", "2", "--max-restarts", "1", epochs=epochs, pause=1.0)
    # in the second epoch's pause: half an epoch done since the first epoch's commit
    _wait_for(lambda: _committed(out)[-1:] == [(0, 2, 1)], "the first commit", job)
    time.sleep(0.3)
    os.kill(int((out / "pid.1.0").read_text()), signal.SIGKILL)
    output = _finish(job)
    committed = _committed(out)
    assert [e for a, _, e in committed if a == 0][-1] in (1, 2), committed  # killed before the third commit
    resumed = [e for a, _, e in committed if a == 1]
    assert resumed == list(range(committed[len(committed) - len(resumed) - 1][2] + 1, epochs + 1)), committed
    assert (out / "pid.0.1").exists() and (out / "pid.1.1").exists(), output[-3000:]  # both workers restarted
    whole, killed = (torch.load(d / "final.pt", weights_only=True) for d in (tmp_path / "whole", out))
    for name, value in whole.items():
        assert torch.equal(value, killed[name]), (name, (value - killed[name]).abs().max())


def test_a_node_joining_restarts_the_worker_and_the_pair_resumes_from_its_last_commit(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{free_port()}"
    node = ["--nproc-per-node", "1", "--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "hvd-elastic"]
    node += ["--max-restarts", "2", "--rdzv-conf", "last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"]
    out = tmp_path / "job"
    first = _start(out, *node, epochs=6, pause=0.5)
    second = None
    try:
        _wait_for(lambda: len(_committed(out)) >= 2, "two commits on one node", first)
        env = {**ENV, "OMP_NUM_THREADS": "1"}
        command = [str(TRAINMESH), "run", *node, str(SCRIPT), str(out), "6", "0.5"]
        second = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        output = _finish(first)
        _finish(second)
    finally:
        for job in (first, second):
            if job is not None and job.poll() is None:
                for pid in descendants(job.pid):
                    os.kill(pid, signal.SIGKILL)
    history = torch.load(out / "checkpoint.pt", weights_only=True)["history"]  # the commits the last one follows
    sizes, epochs = [n for n, _ in history], [e for _, e in history]
    assert epochs == list(range(1, 7)), history  # each epoch once: the pair went on from the last commit
    alone = sizes.count(1)
    assert alone >= 2 and sizes == [1] * alone + [2] * (6 - alone), (history, output[-3000:])
