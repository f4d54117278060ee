"""Faults during a real `trainmesh run` (2 processes, torchrun's agent, restarts allowed): the run
finishes, resumes from the newest committed checkpoint, and ends bit for bit where the uninterrupted
run ends — weights, optimizer state, and every per-step loss after the resume point."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from support import nano_toml
from trainmesh.checkpoint import latest_checkpoint, list_checkpoints, read_full_state, verify

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
OVERRIDES = ["--train.max_steps=8", "--checkpoint.every=2", "--checkpoint.final=true", "--model.dropout=0.1"]


def _command(root: Path, name: str, *flags: str, restarts: int = 1, overrides: list[str] = OVERRIDES) -> list[str]:
    return [
        str(BIN / "trainmesh"),
        "run",
        "gpt",
        "--config",
        str(nano_toml(root)),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        "--run-id",
        name,
        *flags,
        "--",
        *overrides,
    ]


def _env(fault: str = "") -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": fault}


def _train(
    root: Path, name: str, *flags: str, fault: str = "", restarts: int = 1, overrides: list[str] = OVERRIDES
) -> subprocess.CompletedProcess[str]:
    cmd = _command(root, name, *flags, restarts=restarts, overrides=overrides)
    return subprocess.run(cmd, cwd=root, env=_env(fault), capture_output=True, text=True, timeout=240, check=False)


def _losses(run_dir: Path) -> dict[int, float]:
    """The last logged loss of every step (a restarted attempt re-logs the steps it repeats)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor], dict[int, float]]:
    root = tmp_path_factory.mktemp("faults")
    result = _train(root, "reference", restarts=0)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = root / "runs" / "reference"
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_00000008"
    return root, read_full_state(final), _losses(run_dir)


def _assert_same_as_reference(root: Path, name: str, reference: tuple[Path, dict, dict]) -> None:
    _, ref_state, ref_losses = reference
    run_dir = root / "runs" / name
    final = latest_checkpoint(run_dir)
    assert final is not None and final.name == "step_00000008"
    state = read_full_state(final)
    for section in ("model", "optim"):
        for key, value in ref_state[section].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(state[section][key], value), f"{section}.{key}"
    assert _losses(run_dir) == ref_losses


@pytest.mark.parametrize("kind", ["sigkill", "exception", "exit", "segfault"])
def test_a_dying_rank_is_restarted_and_the_run_ends_exactly_as_uninterrupted(kind: str, reference: tuple) -> None:
    root = reference[0]
    result = _train(root, kind, fault=f"rank=1,step=5,kind={kind}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"resumed from \S*step_00000004", result.stderr), result.stderr[-2000:]
    _assert_same_as_reference(root, kind, reference)


def test_two_failures_at_different_steps(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "twice", fault="rank=1,step=3,kind=sigkill;rank=0,step=7,kind=exception", restarts=2)
    assert result.returncode == 0, result.stderr[-3000:]
    _assert_same_as_reference(root, "twice", reference)


def test_killed_while_saving_resumes_from_the_previous_checkpoint(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "mid-save", fault="rank=0,step=4,kind=sigkill,phase=checkpoint")
    assert result.returncode == 0, result.stderr[-3000:]
    # step 4 was never committed, so the restart began at 2
    assert re.search(r"resumed from \S*step_00000002", result.stderr), result.stderr[-2000:]
    _assert_same_as_reference(root, "mid-save", reference)


def test_restarts_exhausted_fail_loudly_and_leave_only_committed_checkpoints(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "exhausted", fault="rank=1,step=5,kind=sigkill", restarts=0)
    assert result.returncode == 1
    assert "rank 1 failed first: killed by signal SIGKILL" in result.stderr
    checkpoints = list_checkpoints(root / "runs" / "exhausted")
    assert [p.name for p in checkpoints] == ["step_00000002", "step_00000004"]
    assert all((p / "trainer_state.json").is_file() for p in checkpoints)


def test_sigterm_stops_at_a_step_boundary_and_relaunch_continues_exactly(tmp_path: Path) -> None:
    """Preemption: SIGTERM to `trainmesh run` -> every rank stops at the same step, saves, exits 75;
    `--resume` then ends bit for bit where an uninterrupted run ends."""
    steps = ["--train.max_steps=150", "--checkpoint.final=true", "--model.dropout=0.1"]
    reference = _train(tmp_path, "ref", restarts=0, overrides=steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job = subprocess.Popen(
        _command(tmp_path, "pre", restarts=0, overrides=steps),
        cwd=tmp_path,
        env=_env(),
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 10):
        time.sleep(0.2)  # until training is well under way
    job.send_signal(signal.SIGTERM)
    _, stderr = job.communicate(timeout=120)
    assert job.returncode == 75, stderr[-3000:]
    stopped = latest_checkpoint(tmp_path / "runs" / "pre")
    assert stopped is not None and 0 < int(stopped.name[5:]) < 150, stderr[-2000:]
    assert "preemption requested: stopping at step" in stderr
    resumed = _train(tmp_path, "pre", "--resume", restarts=0, overrides=steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final, ref = (read_full_state(latest_checkpoint(tmp_path / "runs" / n)) for n in ("pre", "ref"))  # type: ignore[arg-type]
    for key, value in ref["model"].items():
        assert torch.equal(final["model"][key], value), key


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.parametrize(
    ("name", "fault", "stuck"),
    [
        ("stopped", "rank=1,step=3,kind=sigstop", 1),  # a stopped process runs nothing at all
        ("gil-held", "rank=0,step=3,kind=hang", 0),  # no Python thread can run: faulthandler's C timer acts
        ("stuck-loader", "rank=1,step=4,kind=sleep,phase=data", 1),  # the rank's own watchdog sees it
    ],
)
def test_a_stall_is_diagnosed_torn_down_and_restarted(name: str, fault: str, stuck: int, reference: tuple) -> None:
    root = reference[0]
    result = _train(root, name, fault=fault, overrides=[*OVERRIDES, "--dist.stall_timeout_s=3"])
    assert result.returncode == 0, result.stderr[-3000:]
    stalls = root / "runs" / name / "stalls"
    report = (stalls / "attempt_0" / "report.txt").read_text()
    assert f"Did not arrive: rank(s) {stuck}." in report, report
    assert "completed no step for" in report and "after step 3" in report
    waiting_peer = (stalls / "attempt_0" / f"rank_{1 - stuck}.txt").read_text()
    assert re.search(r'trainmesh/train/loop.py", line \d+ in train', waiting_peer), waiting_peer
    if name != "stopped":  # the stuck rank's own stack names the frame it is stuck in
        stack = (stalls / "attempt_0" / f"rank_{stuck}.txt").read_text()
        assert re.search(r'trainmesh/faults.py", line \d+ in _fire', stack), stack
    assert not (stalls / "attempt_1").exists()  # the restarted attempt did not stall (and left no empty files)
    assert not _processes_mentioning(f"runs/{name} "), "a process of the stalled attempt survived"
    _assert_same_as_reference(root, name, reference)


ASYNC = [*OVERRIDES, "--checkpoint.async_save=true"]


def test_async_checkpoints_hold_the_same_bytes_and_the_last_is_durable_at_exit(reference: tuple) -> None:
    """Saved in the background while training goes on (and mutates the weights in place): every
    checkpoint still holds the state of its own step, and the final one is committed before exit."""
    root = reference[0]
    result = _train(root, "async", overrides=ASYNC, restarts=0)
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = root / "runs" / "async"
    assert [p.name for p in list_checkpoints(run_dir)] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    assert all(verify(p).ok for p in list_checkpoints(run_dir))
    _assert_same_as_reference(root, "async", reference)
    middle = read_full_state(run_dir / "checkpoints" / "step_00000004")
    reference_middle = read_full_state(root / "runs" / "reference" / "checkpoints" / "step_00000004")
    for key, value in reference_middle["model"].items():
        assert torch.equal(middle["model"][key], value), key


def test_async_checkpoints_survive_a_kill(reference: tuple) -> None:
    root = reference[0]
    result = _train(root, "async-kill", fault="rank=1,step=5,kind=sigkill", overrides=ASYNC)
    assert result.returncode == 0, result.stderr[-3000:]
    # the save of step 4 may or may not have been committed when step 5 ended: either is a valid resume
    assert re.search(r"resumed from \S*step_0000000[24]", result.stderr), result.stderr[-2000:]
    _assert_same_as_reference(root, "async-kill", reference)


@pytest.mark.parametrize("overrides", [OVERRIDES, ASYNC], ids=["sync", "async"])
def test_a_full_disk_fails_every_rank_alike_and_keeps_the_previous_checkpoint(
    overrides: list[str], reference: tuple
) -> None:
    root = reference[0]
    name = "disk-full-" + ("async" if overrides is ASYNC else "sync")
    result = _train(root, name, fault="rank=1,step=4,kind=diskfull,phase=checkpoint", overrides=overrides, restarts=0)
    assert result.returncode == 1
    run_dir = root / "runs" / name
    for rank in (0, 1):  # the same error, reported by each rank itself
        failed = r"saving checkpoint \S*step_00000004 failed on rank\(s\) \[1\]"
        pattern = rf"\[rank{rank}\] ERROR rank {rank} failed: {failed}"
        assert re.search(pattern, result.stderr), result.stderr[-3000:]
    assert "No space left on device" in result.stderr
    checkpoints = list_checkpoints(run_dir)
    assert [p.name for p in checkpoints] == ["step_00000002"] and verify(checkpoints[0]).ok
    assert not list((run_dir / "checkpoints").glob("step_00000004*"))  # nothing half-written is left
