"""Rank 0's metrics sinks: every record in metrics.jsonl, its numbers as TensorBoard scalars, and trackers that fail
without failing the run."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmesh.metrics import sinks
from trainmesh.metrics.sinks import METRICS_FILE, MetricsWriter, Outcome, Sink, Tracker, read_metrics


def test_records_reach_metrics_jsonl_and_tensorboard(tmp_path: Path) -> None:
    writer = MetricsWriter(tmp_path)
    for step in (1, 2, 3):
        writer.write(step, {"loss": 5.0 - step, "time_data_ms": 0.5 * step, "grad_norm": math.nan})
    writer.write(3, {"val_loss": 1.5}, kind="val")
    writer.close()
    records = read_metrics(tmp_path / METRICS_FILE)
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 2), ("train", 3), ("val", 3)]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["train/loss", "train/time_data_ms", "val/val_loss"]  # NaN left out
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("val/val_loss")] == [(3, 1.5)]
    assert (tmp_path / "loss.png").stat().st_size > 1000


class Recorder:
    """A tracker-like sink that keeps what it gets; `fail_at`: the step whose write raises."""

    name = "recorder"

    def __init__(self, fail_at: int | None = None) -> None:
        self.steps: list[int] = []
        self.outcome = ""
        self.fail_at = fail_at

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        if step == self.fail_at:
            raise ConnectionError("the tracker server went away\nsecond line")
        self.steps.append(step)

    def close(self, outcome: Outcome) -> None:
        self.outcome = outcome


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    """The trainmesh logger's records too, also after a CLI test in this process set it not to propagate."""
    monkeypatch.setattr(logging.getLogger("trainmesh"), "propagate", True)
    return caplog


def _write_steps(writer: MetricsWriter, steps: range) -> None:
    for step in steps:
        writer.write(step, {"loss": float(step)})


def test_a_tracker_that_fails_mid_run_costs_one_warning_and_the_other_sinks_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    failing, healthy = Recorder(fail_at=3), Recorder()
    writer = MetricsWriter(
        tmp_path, tensorboard=False, trackers=[Tracker("bad", lambda: failing), Tracker("ok", lambda: healthy)]
    )
    _write_steps(writer, range(1, 7))
    writer.close("stopped")
    assert failing.steps == [1, 2] and failing.outcome == ""  # dropped at step 3: never written to or closed again
    assert healthy.steps == [1, 2, 3, 4, 5, 6] and healthy.outcome == "stopped"
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3, 4, 5, 6]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "the recorder tracker failed and receives no further metrics" in warnings[0]
    assert "ConnectionError: the tracker server went away" in warnings[0] and "second line" not in warnings[0]
    assert not (tmp_path / "tensorboard").exists()


def test_a_tracker_that_fails_to_start_costs_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    def refuse() -> Sink:
        raise RuntimeError("no API key configured")

    writer = MetricsWriter(tmp_path, trackers=[Tracker("wandb", refuse)])
    _write_steps(writer, range(1, 4))
    writer.close()
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.startswith("the wandb tracker did not start") and "no API key configured" in warning
    assert str(tmp_path / METRICS_FILE) in warning  # where the metrics are instead


LEAKY_URL = "http://me:s3cret@mlflow.example.com:5000/api/2.0/runs/get?run_id=7&access_token=s3cret"


class Leaky:
    """A tracker whose errors quote its URL, credentials and all, as MLflow's do; `fail_in`: write or close."""

    name = "leaky"

    def __init__(self, fail_in: str) -> None:
        self.fail_in = fail_in

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        self._fail("write")

    def close(self, outcome: Outcome) -> None:
        self._fail("close")

    def _fail(self, where: str) -> None:
        if where == self.fail_in:
            raise ConnectionError(f"API request to {LEAKY_URL} failed with exception Max retries exceeded")


def test_a_tracker_error_is_logged_without_the_credentials_of_its_url(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """MLFLOW_TRACKING_URI, unlike the config, may hold user info or a token, and MLflow's errors quote it."""

    def refuse() -> Sink:
        raise ConnectionError(f"API request to {LEAKY_URL} failed")

    started = [Tracker("a", refuse), Tracker("b", lambda: Leaky("write")), Tracker("c", lambda: Leaky("close"))]
    writer = MetricsWriter(tmp_path, tensorboard=False, trackers=started)
    _write_steps(writer, range(1, 3))
    writer.close()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 3, warnings  # a: did not start, b: failed mid-run, c: could not close
    assert all("http://mlflow.example.com:5000/api/2.0/runs/get?run_id=7 failed" in w for w in warnings), warnings
    assert not [w for w in warnings if "s3cret" in w or "me:" in w], warnings


def test_closing_twice_closes_once(tmp_path: Path) -> None:
    sink = Recorder()
    writer = MetricsWriter(tmp_path, tensorboard=False, trackers=[Tracker("r", lambda: sink)])
    writer.close("failed")
    writer.close("finished")  # the loop's own close after train()'s failure path: nothing more happens
    assert sink.outcome == "failed"


def test_a_tracker_that_hangs_at_the_end_is_left_behind_after_its_limit(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped run has seconds before it is killed: closing waits for a hung tracker only so long."""
    release = threading.Event()

    class Hung(Recorder):
        def close(self, outcome: Outcome) -> None:
            release.wait(60)  # an MLflow server that does not answer retries for minutes

    monkeypatch.setitem(sinks.TRACKER_CLOSE_S, "stopped", 0.5)
    writer = MetricsWriter(tmp_path, tensorboard=False, trackers=[Tracker("mlflow", Hung)])
    _write_steps(writer, range(1, 3))
    started = time.monotonic()
    writer.close("stopped")
    assert time.monotonic() - started < 10  # patience 5 s, limit 0.5 s: not the 60 s of the hang
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(w.startswith("gave up waiting for mlflow after 0.5 s") for w in warnings), warnings
    release.set()
