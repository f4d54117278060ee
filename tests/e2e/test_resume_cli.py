"""Resume as trainmesh prints it: a resume starts from the run's own config (not the defaults), a change its
checkpoint cannot load is refused before launch, the run's config.toml changes only once a launch has loaded its
checkpoint (the one before kept in config_history/), and every "Continue with: ..." hint works exactly as printed.
The stop signals' hints (SIGTERM, Ctrl-C at 2 ranks) are run as printed in test_faults.py."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from support import nano_toml
from trainmesh.checkpoint import latest_checkpoint

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# Settings a default config does not have: a resume that fell back to the defaults would build another model
# on other data, and fail to load the checkpoint.
OWN = ["--model.n_embd=48", "--model.n_head=3", "--checkpoint.every=2", "--checkpoint.final=true"]


def _env() -> dict[str, str]:
    path = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "OMP_NUM_THREADS": "1"}


def _trainmesh(root: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return _run(root, ["trainmesh", *args], timeout)


def _run(root: Path, argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=root, env=_env(), capture_output=True, text=True, timeout=timeout, check=False)


def _hint(stderr: str) -> list[str]:
    printed = re.search(r"(?:Continue (?:that run )?with|train it longer): (.*?)(?:\n|$)", stderr)
    assert printed, stderr[-3000:]
    return shlex.split(printed.group(1))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A 4-step run with settings of its own, on a text file (not the embedded corpus). Shared: the refusals
    leave it as it was, and then the hints' test continues it."""
    tmp_path = tmp_path_factory.mktemp("resume")
    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(3000)))
    args = ["run", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "1", "--run-id", "own"]
    done = _trainmesh(tmp_path, *args, "--", *OWN, f"--data.source={text}")
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp_path, tmp_path / "runs" / "own"


def test_a_resume_the_checkpoint_cannot_load_is_refused_before_launch_and_a_failed_launch_writes_nothing(
    trained: tuple[Path, Path],
) -> None:
    root, run_dir = trained
    before = (run_dir / "config.toml").read_bytes()
    files = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    resume = ["gpt", "--nproc-per-node", "1", "--resume", "--run-id", "own", "--"]
    for command in ("check", "run"):
        refused = _trainmesh(root, command, *resume, "--model.n_embd=60")
        assert refused.returncode == 2, refused.stderr[-3000:]
        said = "model.n_embd: the checkpoint has 48, this command gives 60 (--model.n_embd=... on the command line)"
        assert said in refused.stderr and "Fix: leave these keys out" in refused.stderr, refused.stderr[-3000:]
        assert "torchrun" not in refused.stderr
    assert (run_dir / "config.toml").read_bytes() == before
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == files
    if torch.cuda.is_available():
        return
    # The workers fail (no CUDA device here) after the launcher took the folder, before a checkpoint loaded.
    failed = _trainmesh(root, "run", *resume, "--train.max_steps=6", "--dist.device=cuda")
    assert failed.returncode != 0 and "torchrun" in failed.stderr, failed.stderr[-3000:]
    assert (run_dir / "config.toml").read_bytes() == before
    assert not (run_dir / "config_history").exists()


def test_the_hints_of_a_refused_new_run_and_a_finished_one_continue_it_with_its_own_config(
    trained: tuple[Path, Path],
) -> None:
    root, run_dir = trained
    before = (run_dir / "config.toml").read_bytes()
    again = _trainmesh(root, "run", "gpt", "--nproc-per-node", "1", "--run-id", "own")  # a new run, same name
    assert again.returncode == 2 and "already holds checkpoints" in again.stderr, again.stderr[-3000:]
    hint = _hint(again.stderr)
    assert hint == ["trainmesh", "run", "gpt", "--nproc-per-node", "1", "--resume", "--run-id", "own"]
    finished = _run(root, hint)  # the run had finished: nothing to train, and how to train longer
    assert finished.returncode == 0 and "has finished" in finished.stderr, finished.stderr[-3000:]
    longer = _hint(finished.stderr)
    where = f"--run.out_dir={root / 'runs'}"  # its own, recorded: not ./runs, so the command says where
    assert longer[-3:] == ["--", where, "--train.max_steps=8"], longer
    resumed = _run(root, longer)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "run own continues from step 4 with its own config" in resumed.stderr
    assert "the command changes train.max_steps: 4 -> 8" in resumed.stderr
    assert "resumed from" in resumed.stderr and latest_checkpoint(run_dir).name == "step_00000008"  # type: ignore[union-attr]
    config = tomllib.loads((run_dir / "config.toml").read_text())
    assert config["model"]["n_embd"] == 48 and config["data"]["source"].endswith("corpus.txt")
    assert config["train"]["max_steps"] == 8
    assert (run_dir / "config_history" / "step_00000004.toml").read_bytes() == before  # what trained steps 1-4


def test_a_plain_python_worker_stopped_by_sigterm_prints_a_command_that_continues_it(tmp_path: Path) -> None:
    """Without trainmesh's launcher (plain python here; torchrun and srun alike), the worker says how to resume."""
    args = [sys.executable, "-m", "trainmesh", "gpt", "--config", str(nano_toml(tmp_path)), "--run.id=solo"]
    job = subprocess.Popen(
        [*args, "--train.max_steps=60", *OWN], cwd=tmp_path, env=_env(), stderr=subprocess.PIPE, text=True
    )
    run_dir = tmp_path / "runs" / "solo"
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not list(run_dir.glob("checkpoints/step_*")):
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 75, stderr[-3000:]
    hint = _hint(stderr)
    assert hint == [sys.executable, "-m", "trainmesh", "gpt", "--resume", "--run-dir", str(run_dir)], hint
    stopped = latest_checkpoint(run_dir)
    assert stopped is not None
    resumed = _run(tmp_path, hint)  # as printed: its model (n_embd 48) and its 60 steps from config.toml
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {stopped}" in resumed.stderr
    assert latest_checkpoint(run_dir).name == "step_00000060"  # type: ignore[union-attr]
