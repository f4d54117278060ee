"""Multi-node elastic membership (`--nnodes 1:2`, c10d rendezvous on loopback): one agent trains
alone; a second joins and both continue from a checkpoint at world size 2; the second is killed (agent
and worker) and the survivor re-forms the group alone and continues from the newest checkpoint (the
data order and the DCP checkpoint do not depend on the world size); then a replacement started with the
same command joins the survivor, which stops its worker (SIGTERM: a checkpoint), and the two train on
together from it until SIGTERM, as a scheduler sends it, stops both at a step boundary with a checkpoint."""

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
from trainmesh.core.env import free_port

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


def test_a_node_joins_one_is_lost_and_a_replacement_joins_and_the_pair_trains_on(tmp_path: Path) -> None:
    steps = 100_000  # more than the test lasts: it ends the run with SIGTERM once the replacement has saved
    endpoint = f"127.0.0.1:{free_port()}"
    node = [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "1"]
    node += ["--nnodes", "1:2", "--rdzv-endpoint", endpoint, "--rdzv-id", "elastic", "--max-restarts", "3"]
    # A dead node's keep-alive lapses after 3 missed beats 1 s apart (default 5 s apart), and a round that has
    # its minimum waits 3 s for more nodes (default 30): the first node's start alone and the survivor's regrouping
    # each wait that long. A node already waiting joins the next round within about 1 s (it polls every second).
    node += ["--rdzv-conf", "last_call_timeout=3,keep_alive_interval=1,keep_alive_max_attempt=3"]
    node += ["--run-id", "elastic", "--", f"--train.max_steps={steps}", "--checkpoint.every=20"]
    node += ["--train.global_batch=8", "--run.log_every=1", "--checkpoint.final=true"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}  # a SIGKILLed launcher leaves files there
    agents: dict[str, subprocess.Popen[str]] = {}
    run_dir = tmp_path / "runs" / "elastic"

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

    def resumes() -> list[tuple[int, int]]:
        """(step resumed from, data-parallel ranks then) of every resume, from rank 0's log (on either
        node), in order: each resume starts from a later checkpoint than the one before."""
        return sorted(
            (int(step), int(ranks))
            for name in agents
            for step, ranks in re.findall(
                r"resumed from \S*step_(\d+).*?× (\d+) data-parallel rank\(s\)",
                (tmp_path / f"{name}.log").read_text(),
                re.S,
            )
        )

    try:
        start("first")  # it hosts the rendezvous at the endpoint, so it goes first and is not the one lost
        host, port = endpoint.split(":")
        wait_for(lambda: _accepts(host, int(port)), 60, ["first"])
        wait_for(lambda: (run_dir / "checkpoints" / "step_00000020").exists(), 120, ["first"])  # alone
        start("doomed")  # the job grows: both restart their workers, which continue from a checkpoint
        wait_for(lambda: any(ranks == 2 for _, ranks in resumes()), 90, ["first", "doomed"])
        grown_at = max(step for step, ranks in resumes() if ranks == 2)
        after = run_dir / "checkpoints" / f"step_{(grown_at // 20 + 1) * 20:08d}"  # the pair's first save
        wait_for(after.exists, 90, ["first", "doomed"])
        _kill_node(agents["doomed"])
        wait_for(lambda: [ranks for _, ranks in resumes()][-1:] == [1], 90, ["first"])  # the survivor alone
        start("replacement")
        wait_for(lambda: [ranks for _, ranks in resumes()][-1:] == [2] and len(resumes()) >= 3, 90, ["first"])
        replaced = resumes()[-1][0]
        saved = run_dir / "checkpoints" / f"step_{(replaced // 20 + 1) * 20:08d}"  # the new pair's first save
        wait_for(saved.exists, 90, ["first", "replacement"])
        for name in ("first", "replacement"):  # the pair trains on; stop it as a scheduler would: SIGTERM
            agents[name].send_signal(signal.SIGTERM)
        for name in ("first", "replacement"):
            assert agents[name].wait(timeout=60) == 75, logs()  # stopped at a step boundary, with a checkpoint
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                _kill_node(agent)
    final = latest_checkpoint(run_dir)
    assert final is not None and int(final.name[5:]) >= int(saved.name[5:]) and verify(final).ok
    (grown, two), (alone, one), (replaced, two_again) = resumes()[:3]
    # The growth continued from step 20 or later at world size 2, the survivor from a checkpoint of
    # the pair, and the pair with the replacement from what the survivor saved alone.
    assert (two, one, two_again) == (2, 1, 2) and 20 <= grown < alone < replaced, logs()
    # The first node's ranks, restarted as the second joined (no restart counted), wrote the round with one node
    # into attempt_0 and the next into attempt_0-2: the second round did not empty the first one's files.
    first_launch = min((run_dir / "logs").iterdir())  # named by when each node's launch started
    rounds = sorted(p.name for p in first_launch.glob("attempt_*"))
    assert rounds[:2] == ["attempt_0", "attempt_0-2"], rounds
    alone_log = (first_launch / "attempt_0" / "rank_0" / "stderr.log").read_text()
    assert "step_00000020" in alone_log and "resumed from" not in alone_log  # the first round's, not the next's
    assert "resumed from" in (first_launch / "attempt_0-2" / "rank_0" / "stderr.log").read_text()
