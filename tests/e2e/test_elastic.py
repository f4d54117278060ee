"""Multi-node elastic membership (`--nnodes 1:2`, c10d rendezvous on loopback): two agents train
together, one is killed (agent and worker), and the survivor re-forms the group alone and continues
from the newest checkpoint on half the world size (the data order and the DCP checkpoint do not depend
on it). Then a replacement started with the same command joins the survivor, which stops its worker
(SIGTERM: a checkpoint), and the two finish the run together at world size 2."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from support import descendants, nano_toml
from trainmesh.checkpoint import latest_checkpoint, verify
from trainmesh.runtime.env import free_port

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex((host, port)) == 0


def _kill_node(agent: subprocess.Popen[str]) -> None:
    """SIGKILL the agent and its workers (torchrun starts each worker in a session of its own)."""
    for pid in descendants(agent.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    agent.wait()


def test_a_killed_agent_is_replaced_and_the_pair_completes_the_run(tmp_path: Path) -> None:
    steps = 900  # enough to outlast the kill, the survivor alone and the replacement joining
    endpoint = f"127.0.0.1:{free_port()}"
    node = [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "1"]
    node += ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "replaced", "--max-restarts", "3"]
    # A dead node's keep-alive lapses after 2 x 3 s (default 5 x 3), and a round that has its minimum
    # waits 10 s for more nodes (default 30; long enough for the second agent to make the first round).
    node += ["--rdzv-conf", "last_call_timeout=10,keep_alive_interval=2,keep_alive_max_attempt=3"]
    node += ["--run-id", "replaced", "--", f"--train.max_steps={steps}", "--checkpoint.every=20"]
    node += ["--train.global_batch=8", "--run.log_every=1", "--checkpoint.final=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents: dict[str, subprocess.Popen[str]] = {}

    def start(name: str) -> None:
        log = (tmp_path / f"{name}.log").open("w")
        agents[name] = subprocess.Popen(
            node, cwd=tmp_path, env=env, stdout=log, stderr=log, text=True, start_new_session=True
        )

    def logs() -> str:
        return "".join(f"\n==== {name}.log\n" + (tmp_path / f"{name}.log").read_text()[-3000:] for name in agents)

    def wait_for(done: Callable[[], bool], limit_s: float, alive: list[str]) -> None:
        deadline = time.monotonic() + limit_s
        while not done():
            assert time.monotonic() < deadline, logs()
            assert all(agents[name].poll() is None for name in alive), logs()
            time.sleep(0.2)

    run_dir = tmp_path / "runs" / "replaced"
    try:
        start("first")  # it hosts the rendezvous at the endpoint, so it goes first and is not the one lost
        host, port = endpoint.split(":")
        wait_for(lambda: _accepts(host, int(port)), 60, ["first"])
        start("doomed")
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000040").exists(), 120, ["first", "doomed"])
        _kill_node(agents["doomed"])

        def training_alone() -> bool:  # resumed, and on the one node left
            tail = (tmp_path / "first.log").read_text().split("resumed from")
            return len(tail) > 1 and "1 data-parallel rank(s)" in tail[-1]

        wait_for(training_alone, 90, ["first"])
        start("replacement")
        for name in ("first", "replacement"):
            assert agents[name].wait(timeout=150) == 0, logs()
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                _kill_node(agent)
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == f"step_{steps:08d}" and verify(final).ok
    # (step resumed from, data-parallel ranks then) of every resume, from rank 0's log (either node's)
    resumes = [
        (int(step), int(ranks))
        for name in ("first", "replacement")
        for step, ranks in re.findall(
            r"resumed from \S*step_(\d+).*?× (\d+) data-parallel rank\(s\)",
            (tmp_path / f"{name}.log").read_text(),
            re.S,
        )
    ]
    alone = [step for step, ranks in resumes if ranks == 1]
    together = [step for step, ranks in resumes if ranks == 2]
    assert alone and min(alone) >= 40, logs()  # the survivor continued from a checkpoint taken before the kill
    assert together and max(together) > min(alone), logs()  # then the pair, from what the survivor saved alone
