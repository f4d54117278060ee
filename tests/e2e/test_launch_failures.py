"""Bad launch input fails within seconds, saying what to check — never a 30-minute hang — and a
single-node run listens on loopback only."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from support import descendants, nano_toml
from trainmesh.core.env import free_port
from trainmesh.core.errors import EXIT_STALLED, EXIT_USER_ERROR
from trainmesh.launch.outcome import EXIT_MEANINGS, explain_failure

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
QUICK = 60  # seconds: a hard stop for a hung command, far below any default timeout (300-900 s)
STARTUP = 20  # seconds a launch takes to start and give up, beyond the timeout under test (a loaded 2-core CI box)
JOIN = 3  # the join / init timeout these tests set


def _run(root: Path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    start = time.monotonic()
    result = subprocess.run(
        [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(root)), *args],
        cwd=root,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        capture_output=True,
        text=True,
        timeout=QUICK,
        check=False,
    )
    return result, time.monotonic() - start


def _node_of_two(node_rank: int, port: int) -> list[str]:
    """One node of a static two-node launch, alone; rendezvous given 3 s."""
    where = ["--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", str(JOIN)]
    return ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(node_rank), *where]


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_a_port_in_use_is_refused_at_once(tmp_path: Path, busy_port: int) -> None:
    result, took = _run(tmp_path, "--nproc-per-node", "1", "--master-port", str(busy_port))
    assert result.returncode == 2 and took < STARTUP
    assert f"--master-port={busy_port}" in result.stderr and "already in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_nothing_listening_at_the_master_fails_within_the_join_timeout(tmp_path: Path) -> None:
    port = free_port()
    flags = ["--nproc-per-node", "1", "--nnodes", "2", "--node-rank", "1"]
    result, took = _run(
        tmp_path, *flags, "--master-addr", "127.0.0.1", "--master-port", str(port), "--join-timeout", str(JOIN)
    )
    assert result.returncode == 1 and took < JOIN + STARTUP
    assert f"nothing answered at 127.0.0.1:{port} within --join-timeout=3 s" in result.stderr
    assert "Check that node 0 is running" in result.stderr


def test_a_world_that_never_fills_fails_within_the_join_timeout(tmp_path: Path) -> None:
    port = free_port()
    result, took = _run(tmp_path, *_node_of_two(0, port))
    assert result.returncode == 1 and took < JOIN + STARTUP
    assert f"the nodes did not all join at 127.0.0.1:{port}" in result.stderr and "1/2" in result.stderr


def test_world_size_larger_than_the_processes_that_come(tmp_path: Path) -> None:
    """A worker started by hand (no torchrun) that waits for a peer who never comes."""
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    start = time.monotonic()
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainmesh",
            "gpt",
            "--config",
            str(nano_toml(tmp_path)),
            f"--dist.init_timeout_s={JOIN}",
        ],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        capture_output=True,
        text=True,
        timeout=QUICK,
        check=False,
    )
    assert result.returncode != 0 and time.monotonic() - start < JOIN + STARTUP
    assert "rank 0 of 2 could not join the process group at 127.0.0.1" in result.stderr
    assert "dist.init_timeout_s=3" in result.stderr and "1/2" in result.stderr


def test_a_scripts_own_exit_code_is_not_given_trainmeshs_meaning(tmp_path: Path) -> None:
    """argparse exits 2 on a missing argument: a script's code, reported as a number and not as trainmesh's 2 (fix
    the config); `trainmesh run` exits 1, as for any failed rank."""
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\nparser = argparse.ArgumentParser()\nparser.add_argument('--epochs', required=True)\n"
        "parser.parse_args()\n"
    )
    result = subprocess.run(
        [str(BIN / "trainmesh"), "run", "--nproc-per-node", "1", str(script)],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=QUICK,
        check=False,
    )
    assert "the following arguments are required: --epochs" in result.stderr  # argparse's, from the script
    assert "rank 0 failed first: exit code 2" in result.stderr
    assert "To enable traceback see" not in result.stderr  # torch's placeholder for a rank without an error file
    assert EXIT_MEANINGS[2] not in result.stderr and result.returncode == 1


@pytest.mark.parametrize("worker", [True, False])
def test_only_trainmeshs_workers_exit_codes_carry_its_meanings(worker: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The report of the same failure (exit codes 2 and 76), from trainmesh's worker and from a script."""
    failures = {0: ProcessFailure(0, 100, EXIT_USER_ERROR, ""), 1: ProcessFailure(1, 101, EXIT_STALLED, "")}
    failures[1].timestamp = failures[0].timestamp + 1  # rank 0 failed first
    code = explain_failure(ChildFailedError("entry", failures), None, worker=worker)
    said = [r.getMessage() for r in caplog.records]
    if worker:
        assert said[0] == f"rank 0 failed first: exit code 2: {EXIT_MEANINGS[EXIT_USER_ERROR]}"
        assert said[-1] == f"rank 1 then: exit code 76: {EXIT_MEANINGS[EXIT_STALLED]}" and code == EXIT_USER_ERROR
    else:
        assert said[0] == "rank 0 failed first: exit code 2" and said[-1] == "rank 1 then: exit code 76" and code == 1


def _listening_addresses(pids: list[int]) -> set[str]:
    """host:port of every TCP socket in LISTEN state owned by `pids` (from /proc, Linux only)."""
    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    addresses = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                host, port = fields[1].split(":")
                ip = socket.inet_ntop(
                    socket.AF_INET if width == 8 else socket.AF_INET6,
                    bytes.fromhex(host)[::-1] if width == 8 else _ipv6(host),
                )
                addresses.add(f"{ip}:{int(port, 16)}")
    return addresses


def _ipv6(host: str) -> bytes:
    words = [bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, 32, 8)]  # four little-endian 32-bit words
    return b"".join(words)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from /proc (Linux)")
def test_a_single_node_run_listens_on_loopback_only(tmp_path: Path) -> None:
    cmd = [str(BIN / "trainmesh"), "run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2"]
    cmd += ["--run-id", "listen", "--", "--train.max_steps=100000", "--run.log_every=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "runs" / "listen" / "metrics.jsonl"
        deadline = time.monotonic() + QUICK
        while not (metrics.exists() and metrics.read_text().count("\n") > 2) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert metrics.exists(), "training did not start"
        pids = descendants(proc.pid)
        assert len(pids) >= 3  # the agent and two workers
        addresses = _listening_addresses(pids)
        assert addresses, "found no listening socket at all: the check itself is broken"
        assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
    finally:
        proc.send_signal(signal.SIGTERM)  # preemption: a clean stop
        proc.communicate(timeout=QUICK)
