"""What a GPU run reports about itself: MFU and peak memory at a real model size, a profiler trace with
CUDA kernels in it, and a memory snapshot when a rank runs out of memory."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from support import nano_config, train_records
from trainmesh.job.worker import run_worker
from trainmesh.testing import run_distributed

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _train(rank: int, root: str, overrides: list[str]) -> None:
    config = nano_config(Path(root), *overrides)
    run_worker(config, Path(root) / "runs" / config.run.id)


def test_mfu_and_peak_memory_are_plausible_for_gpt2_small(tmp_path: Path) -> None:
    """GPT-2 124M shape (byte vocabulary), bf16, no compile: MFU well above 1% and below 100%, and the peak
    memory between the weights + AdamW state (~1.4 GB) and the card's size."""
    overrides = [
        "--model.size=gpt2",
        "--model.block_size=1024",
        "--data.max_corpus_mb=2",
        "--train.micro_batch=8",
        "--train.precision=bf16-mixed",
        "--train.max_steps=12",
        "--run.log_every=4",
        "--run.id=m",
    ]
    run_distributed(_train, 1, args=(str(tmp_path), overrides), timeout_s=180)
    last = train_records(tmp_path / "runs" / "m")[-1]  # steps 9-12: past the first steps' allocations
    assert 0.01 < last["mfu"] < 1.0, last
    total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
    assert 1.4 < last["peak_mem_gb"] < total_gb, last


def test_profiler_trace_holds_cuda_kernels_and_the_step_phases(tmp_path: Path) -> None:
    overrides = ["--profile.enabled=true", "--profile.wait=1", "--profile.warmup=1", "--profile.active=2"]
    overrides += ["--train.max_steps=6", "--run.id=p"]
    run_distributed(_train, 1, args=(str(tmp_path), overrides), timeout_s=120)
    (trace,) = (tmp_path / "runs" / "p" / "profile" / "rank_0").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) > 50, len(kernels)  # two steps of a 2-layer GPT: matmuls, softmax, AdamW, ...
    phases = {e["name"] for e in events if e.get("cat") == "user_annotation"}
    assert {"trainmesh.data", "trainmesh.forward_backward", "trainmesh.optimizer", "trainmesh.log"} <= phases


def _out_of_memory_rank(rank: int, root: str, overrides: list[str]) -> dict[str, Any]:
    torch.cuda.set_per_process_memory_fraction(0.002)  # ~160 MB: GPT-2 small's weights alone are 500 MB
    try:
        _train(rank, root, overrides)
    except torch.OutOfMemoryError:
        snapshot = Path(root) / "runs" / "oom" / "memory" / "oom_rank_0.pickle"
        with snapshot.open("rb") as f:
            data = pickle.load(f)  # the snapshot is ours, written by this test's own run
        return {"segments": len(data["segments"]), "traces": len(data["device_traces"][0])}
    return {}


def test_out_of_memory_writes_a_memory_snapshot(tmp_path: Path) -> None:
    overrides = ["--model.size=gpt2", "--profile.oom_snapshot=true", "--run.id=oom"]
    (result,) = run_distributed(_out_of_memory_rank, 1, args=(str(tmp_path), overrides), timeout_s=120)
    assert result, "the run did not run out of memory"
    assert result["segments"] > 0 and result["traces"] > 0
