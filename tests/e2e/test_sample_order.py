"""Each sample is consumed exactly as in the uninterrupted run — across a kill, a restart and epoch
boundaries — checked from the ids that every rank logs as it trains (scripts/consumed_ids.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.scripts.consumed_ids import IdLoggingRecipe
from support import nano_toml
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
SCRIPT = Path(__file__).parent / "scripts" / "consumed_ids.py"
# 40 training samples, 8 per optimizer step (4 per rank): an epoch is 5 steps, so 12 steps cross two.
OVERRIDES = ["--train.max_steps=12", "--checkpoint.every=4", "--train.global_batch=8", "--model.dropout=0.1"]


def _train(root: Path, name: str, fault: str = "") -> Path:
    run_dir = root / "runs" / name
    cmd = [str(BIN / "trainmesh"), "run", "--nproc-per-node", "2", "--max-restarts", "1", str(SCRIPT)]
    cmd += ["--config", str(nano_toml(root)), "--run-dir", str(run_dir), *OVERRIDES]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRAINMESH_FAULT": fault}
    result = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _consumed(run_dir: Path, rank: int) -> dict[int, list[list[int]]]:
    """attempt -> the ids of each micro-batch this rank trained on, in order."""
    attempts: dict[int, list[list[int]]] = {}
    for line in (run_dir / "consumed" / f"rank_{rank}.jsonl").read_text().splitlines():
        record = json.loads(line)
        attempts.setdefault(record["attempt"], []).append(record["ids"])
    return attempts


def test_each_sample_is_consumed_exactly_as_uninterrupted_across_epochs(tmp_path: Path) -> None:
    # The uninterrupted reference in this process's ranks (the script's worker and config, without a launch's
    # start-up); the run that loses a rank through `trainmesh run` with the script, restarted by torchrun.
    nano_toml(tmp_path)  # written once, before the ranks read it
    run_distributed(consumed_ids_rank, 2, args=(str(tmp_path), OVERRIDES, "reference"))
    reference = tmp_path / "runs" / "reference"
    faulty = _train(tmp_path, "killed", fault="rank=1,step=6,kind=sigkill")  # after the checkpoint of step 4

    ref = {rank: _consumed(reference, rank) for rank in (0, 1)}
    assert all(list(ref[rank]) == [0] and len(ref[rank][0]) == 12 for rank in (0, 1))
    for epoch in range(2):  # each full epoch: every sample once over both ranks
        steps = range(5 * epoch, 5 * epoch + 5)
        ids = sorted(i for rank in (0, 1) for step in steps for i in ref[rank][0][step])
        assert ids == list(range(40)), f"epoch {epoch}"
    assert ref[0][0][:5] != ref[0][0][5:10]  # and the order is reshuffled between epochs

    for rank in (0, 1):
        got = _consumed(faulty, rank)
        assert sorted(got) == [0, 1], "expected exactly one restart"
        before, after = got[0], got[1]
        assert len(before) >= 6 and before == ref[rank][0][: len(before)]  # the first attempt, until the kill
        assert after == ref[rank][0][4:]  # resumed at step 4: the same batches, through the epoch boundaries


def consumed_ids_rank(rank: int, root: str, overrides: list[str], name: str = "regrouped") -> None:
    """scripts/consumed_ids.py's worker, in a rank of run_distributed."""
    run_dir = Path(root) / "runs" / name
    (run_dir / "consumed").mkdir(parents=True, exist_ok=True)
    config = load_config(str(Path(root) / "nano.toml"), ["--train.micro_batch=4", *overrides], "gpt")  # nano_toml's
    run_worker(config, run_dir, recipe=IdLoggingRecipe(run_dir / "consumed"))


def test_a_resume_with_another_global_batch_repeats_and_skips_no_sample(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """`train.global_batch` unset: 2 processes take 8 samples a step, 1 process 4. Stopped after 3 steps on 2
    processes and resumed on 1, the run continues at the 25th sample of the epoch (not at 3 × 4 = 12, which
    would re-read 12 samples), says so, and the first epoch still holds every sample exactly once."""
    run_dir = tmp_path / "runs" / "regrouped"
    nano_toml(tmp_path)  # written once, before the ranks read it
    run_distributed(consumed_ids_rank, 2, args=(str(tmp_path), ["--train.max_steps=3", "--checkpoint.final=true"]))
    resumed = ["--train.max_steps=8", "--checkpoint.resume=true"]
    run_distributed(consumed_ids_rank, 1, args=(str(tmp_path), resumed))
    log = capfd.readouterr().err
    assert "trained with a global batch of 8 samples per step, this run takes 4" in log
    assert "continues at sample 24 of epoch 0's order: no sample is repeated or skipped" in log
    first = [i for rank in (0, 1) for ids in _consumed(run_dir, rank)[0][:3] for i in ids]  # 3 steps × 4 per rank
    second = [i for ids in _consumed(run_dir, 0)[0][3:] for i in ids]  # rank 0 of the 1-process run
    epoch = first + second[:16]  # 40 samples: 24 before the resume, 16 after
    assert sorted(epoch) == list(range(40)), "a sample was repeated or skipped across the resume"
    assert len(second) == 5 * 4  # 4 steps to the end of epoch 0, then one of epoch 1
