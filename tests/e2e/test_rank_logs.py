"""Every rank's stdout and stderr in files (`<run>/logs/<launch>/attempt_<n>/rank_<r>/`), local rank 0 on the
console, and a failed rank's log named, and its end shown, by the launcher."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support import nano_toml, rank_output

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SCRIPT = """
import os, sys
rank = os.environ["RANK"]
print(f"out of rank {rank}", flush=True)
print(f"err of rank {rank}", file=sys.stderr, flush=True)
"""


def _trainmesh(cwd: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": fault}
    return subprocess.run(
        [str(BIN / "trainmesh"), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=180, check=False
    )


def _launches(log_dir: Path) -> list[Path]:
    return sorted(log_dir.iterdir())


def test_every_rank_keeps_both_streams_and_the_console_shows_local_rank_0(tmp_path: Path) -> None:
    """A script (no run folder) with --log-dir: torchrun's tee into trainmesh's layout."""
    (tmp_path / "hello.py").write_text(SCRIPT)
    result = _trainmesh(tmp_path, "run", "--nproc-per-node", "2", "--log-dir", "logs", "hello.py")
    assert result.returncode == 0, result.stderr[-3000:]
    (launch,) = _launches(tmp_path / "logs")
    assert re.fullmatch(r"\d{8}-\d{6}", launch.name)  # when the launch started
    for rank in (0, 1):
        folder = launch / "attempt_0" / f"rank_{rank}"
        assert (folder / "stdout.log").read_text() == f"out of rank {rank}\n"
        assert (folder / "stderr.log").read_text() == f"err of rank {rank}\n"
    assert "[rank0]:out of rank 0" in result.stdout and "[rank0]:err of rank 0" in result.stderr  # tee'd, prefixed
    assert "rank 1" not in result.stdout + result.stderr.replace("rank_<r>", "")  # only in its files
    assert f"each rank's stdout and stderr: logs/{launch.name}/attempt_<n>/rank_<r>/" in result.stderr

    plain = _trainmesh(tmp_path, "run", "--nproc-per-node", "2", "hello.py")  # a script's default: plain torchrun
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert "out of rank 0" in plain.stdout and "out of rank 1" in plain.stdout and "[rank" not in plain.stdout
    assert len(_launches(tmp_path / "logs")) == 1  # nothing more written


def test_a_recipe_run_keeps_its_ranks_logs_in_the_run_folder(tmp_path: Path) -> None:
    args = ["run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2", "--run-id", "kept"]
    result = _trainmesh(tmp_path, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    logs = tmp_path / "runs" / "kept" / "logs"
    (launch,) = _launches(logs)
    assert sorted(p.name for p in (launch / "attempt_0").iterdir()) == ["rank_0", "rank_1"]
    rank0 = rank_output(logs, 0)
    assert "done: 4 steps" in rank0 and "[rank0]:" + rank0.splitlines()[-1] in result.stderr  # the console's lines
    assert "Traceback" not in rank_output(logs, 1)

    again = _trainmesh(tmp_path, *args[:-2], "--run-id", "kept", "--resume", "--", "--train.max_steps=6")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(_launches(logs)) == 2 and "done: 6 steps" in rank_output(logs, 0)  # a launch does not overwrite


def test_a_failing_rank_leaves_its_traceback_in_its_log_and_the_launcher_names_it(tmp_path: Path) -> None:
    args = ["run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2", "--run-id", "fails"]
    result = _trainmesh(tmp_path, *args, fault="rank=1,step=2,kind=exception")
    assert result.returncode == 1
    (launch,) = _launches(tmp_path / "runs" / "fails" / "logs")
    stderr_log = launch / "attempt_0" / "rank_1" / "stderr.log"
    traceback = stderr_log.read_text()
    assert "Traceback (most recent call last)" in traceback and "InjectedFault: injected fault" in traceback
    named = re.search(r"rank 1 failed first: exit code 1; its output: (\S+)", result.stderr)
    assert named, result.stderr[-3000:]
    assert Path(tmp_path / named.group(1)) == stderr_log  # relative to where trainmesh ran
    # The console showed local rank 0 only: the launcher shows the end of rank 1's file.
    assert f"the end of rank 1's {named.group(1)}:" in result.stderr
    assert "  | [rank1]: trainmesh.train.faults.InjectedFault: injected fault" in result.stderr
    # Rank 0 fails next (its peer is gone), or torchrun's agent stops it first.
    then = r"rank 0 then: (exit code 1|killed by signal SIGTERM \(-15\)); its output: \S+/attempt_0/rank_0/stderr\.log"
    assert re.search(then, result.stderr), result.stderr[-3000:]
