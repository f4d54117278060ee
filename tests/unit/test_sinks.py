"""Rank 0's metrics files: every record in metrics.jsonl, and its numbers as TensorBoard scalars."""

from __future__ import annotations

import math
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainmesh.metrics.sinks import METRICS_FILE, MetricsWriter, read_metrics


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
