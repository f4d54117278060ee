"""Where metrics go: metrics.jsonl and TensorBoard during the run, a loss-curve PNG at the end.

Only rank 0 creates a `MetricsWriter`; other ranks never touch the run directory. Records are written
by a background thread: serialising TensorBoard events costs rank 0 about half a millisecond per
record, and every other rank would wait for it at the next collective. Files are made through
core/files.py: a symlink planted at `metrics.jsonl` or `loss.png` is refused or replaced, never
written through.
"""

from __future__ import annotations

import io
import json
import math
import queue
import threading
from pathlib import Path
from typing import Any

from trainmesh.core.files import make_dirs, open_file, write_atomically
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class MetricsWriter:
    def __init__(self, run_dir: Path, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        self._jsonl = open_file(run_dir / METRICS_FILE, "a", encoding="utf-8")
        self._tb: Any = None
        if tensorboard:
            try:
                from torch.utils.tensorboard.writer import FileWriter

                self._tb = FileWriter(str(make_dirs(run_dir, "tensorboard")))
            except ImportError:  # tensorboard is a declared dependency; keep training if it was removed
                log.warning("tensorboard is not installed; metrics go to %s only", METRICS_FILE)
        self._lost = 0  # records that could not be written
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, name="trainmesh-metrics", daemon=True)
        self._thread.start()

    def write(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Queue one record (returns at once)."""
        self._queue.put({"kind": kind, "step": step, **metrics})

    def close(self) -> None:
        """Write everything queued, close the files and draw the loss curve."""
        self._queue.put(None)
        self._thread.join()
        if self._lost:
            log.error("%d metrics record(s) could not be written to %s", self._lost, self.run_dir)
        try:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()
            plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE)
        except OSError as e:
            log.error("could not finish the metrics files in %s: %s", self.run_dir, e)

    def _drain(self) -> None:
        while (record := self._queue.get()) is not None:
            try:
                self._jsonl.write(json.dumps(record) + "\n")
                self._jsonl.flush()
                if self._tb is not None:
                    self._tb.add_summary(_summary(record), record["step"])
            except Exception as e:  # a full disk must not kill training; say so, once
                self._lost += 1
                if self._lost == 1:
                    log.error("could not write a metrics record to %s: %s (training goes on)", self.run_dir, e)


def _summary(record: dict[str, Any]) -> Any:
    """A record's numbers as one TensorBoard event of scalars `<kind>/<key>`: one event per record, not one
    per scalar (SummaryWriter.add_scalar's way), costs a ninth of the CPU time (about 0.1 ms for 17 scalars
    here), which the training process's other thread would otherwise take from the step."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    kind = record["kind"]
    values = [
        Summary.Value(tag=f"{kind}/{key}", simple_value=float(value))
        for key, value in record.items()
        if key not in ("kind", "step") and isinstance(value, (int, float)) and math.isfinite(value)
    ]
    return Summary(value=values)


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open_file(path, "r", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(metrics_path: Path, out: Path) -> Path | None:
    """Train and validation loss against step, as a PNG."""
    records = read_metrics(metrics_path) if metrics_path.is_file() else []
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train" and "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if r["kind"] == "val" and "val_loss" in r]
    if not train and not val:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1.2)
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="val loss", linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(metrics_path.parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    write_figure(fig, out)
    return out


def write_figure(fig: Any, path: Path) -> None:
    """Save a matplotlib figure as PNG under a temporary name and rename it into place; close it."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_atomically(path, png.getvalue())
