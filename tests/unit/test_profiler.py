"""The [profile] section on CPU: traces with the step phases, the out-of-memory hint, rank lists; and the
TF32 switch's MFU peak and start-of-run line (the GPU side is in tests/gpu)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from support import nano_config
from trainmesh.config import ConfigError
from trainmesh.config.schema import DistConfig, ProfileConfig
from trainmesh.core.dist import set_tf32, tf32_note
from trainmesh.job.worker import run_worker
from trainmesh.metrics import mfu
from trainmesh.metrics.profiler import PHASES, StepProfiler
from trainmesh.runtime.runtime import Runtime

CPU = torch.device("cpu")


def test_a_profiled_run_writes_a_trace_of_the_active_steps_with_every_phase(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    profile = ["--profile.enabled=true", "--profile.wait=1", "--profile.warmup=1", "--profile.active=2"]
    config = nano_config(tmp_path, *profile, "--train.max_steps=6", "--run.id=p")
    run_worker(config, tmp_path / "runs" / "p")
    (trace,) = (tmp_path / "runs" / "p" / "profile" / "rank_0").glob("*.pt.trace.json")
    events = json.loads(trace.read_text())["traceEvents"]
    annotations = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    for phase in PHASES:  # each phase of each of the 2 active steps, nothing from the others
        assert annotations.count(f"trainmesh.{phase}") == 2, (phase, sorted(set(annotations)))
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in events)
    log = capfd.readouterr().err
    assert f"profiler trace of rank 0: {trace} (open it in https://ui.perfetto.dev" in log


def test_without_profile_nothing_is_recorded(tmp_path: Path) -> None:
    run_worker(nano_config(tmp_path, "--run.id=q"), tmp_path / "runs" / "q")
    assert not (tmp_path / "runs" / "q" / "profile").exists()


def test_only_the_listed_ranks_record(tmp_path: Path) -> None:
    cfg = ProfileConfig(enabled=True, ranks="1,3")
    assert [StepProfiler(cfg, tmp_path, r, CPU).recording for r in range(4)] == [False, True, False, True]
    assert StepProfiler(ProfileConfig(enabled=True, ranks="all"), tmp_path, 7, CPU).recording


@pytest.mark.parametrize("ranks", ["", "0,", "rank0", "-1"])
def test_a_malformed_rank_list_is_refused_naming_the_key(tmp_path: Path, ranks: str) -> None:
    with pytest.raises(ConfigError, match=r"profile.ranks=.*comma-separated ranks"):
        nano_config(tmp_path, f"--profile.ranks={ranks}")


def test_out_of_memory_without_a_snapshot_says_how_to_get_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with (
        caplog.at_level(logging.ERROR, logger="trainmesh"),
        pytest.raises(torch.OutOfMemoryError),
        StepProfiler(ProfileConfig(), tmp_path, 0, CPU),
    ):
        raise torch.OutOfMemoryError("CUDA out of memory")
    assert "--profile.oom_snapshot=true" in caplog.text
    assert not (tmp_path / "memory").exists()


def test_mfu_counts_float32_against_the_tf32_peak_only_with_tf32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    with_tf32 = mfu.device_peak(cuda, torch.float32, tf32=True)
    assert with_tf32 is not None and with_tf32.flops == 494.7e12 and "float32 on TF32" in with_tf32.describe()
    assert getattr(mfu.device_peak(cuda, torch.float32), "flops", None) == 67e12
    assert getattr(mfu.device_peak(cuda, torch.bfloat16, tf32=True), "flops", None) == 989e12


def test_tf32_leaves_cpu_matmuls_alone() -> None:
    before = torch.get_float32_matmul_precision()
    set_tf32(CPU, True)
    assert torch.get_float32_matmul_precision() == before


def test_tf32_is_reported_where_it_applies_and_only_there(capfd: pytest.CaptureFixture[str]) -> None:
    """set_tf32 on a CUDA device sets the process-wide switches a GPU reads (settable without one), and the line
    a run logs at start says what they are; a CPU has no TF32: no line, and the runtime says it is off."""
    cuda = torch.device("cuda")
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        set_tf32(cuda, True)
        assert tf32_note(cuda) == (
            "TF32 matmuls: on (train.tf32=true: float32 matmuls and cuDNN convolutions on TF32 tensor cores)"
        )
        set_tf32(cuda, False)
        assert tf32_note(cuda) == "TF32 matmuls: off (train.tf32=false: full float32 matmuls)"
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert tf32_note(CPU) is None
    runtime = Runtime(dist_config=DistConfig(device="cpu"), tf32=True)
    runtime.print("runtime ready")  # rank 0's log, where the TF32 line would be
    log = capfd.readouterr().err
    assert "runtime ready" in log and "TF32" not in log and not runtime.tf32


def test_an_out_of_memory_wrapped_in_another_error_is_still_recognised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pipeline stage re-raises a forward's failure as RuntimeError(...) from the original."""
    with (
        caplog.at_level(logging.ERROR, logger="trainmesh"),
        pytest.raises(RuntimeError),
        StepProfiler(ProfileConfig(), tmp_path, 0, CPU),
    ):
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as e:
            raise RuntimeError("stage 0 forward failed") from e
    assert "--profile.oom_snapshot=true" in caplog.text


def test_a_trace_that_cannot_be_written_does_not_hide_the_error_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiler = StepProfiler(ProfileConfig(enabled=True), tmp_path, 0, CPU)

    def full_disk() -> None:
        raise OSError(28, "No space left on device")

    with pytest.raises(ValueError, match="the real error"), profiler:
        monkeypatch.setattr(profiler._profiler, "stop", full_disk)
        raise ValueError("the real error")
