"""Where metrics go: metrics.jsonl (always), TensorBoard and experiment trackers during the run, a loss-curve PNG at the
end; written by rank 0 only, from background threads.

Details: docs/internals.md#metricssinkspy
"""

from __future__ import annotations

import io
import json
import math
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from trainmesh.config.log import redact
from trainmesh.core.files import make_dirs, open_file, write_atomically
from trainmesh.core.logging import get_logger

log = get_logger(__name__)

METRICS_FILE = "metrics.jsonl"
TRACKER_CLOSE_S: dict[str, float] = {"finished": 120.0, "stopped": 10.0, "failed": 10.0}
"""How long the end of a run waits for its trackers to finish sending, by outcome."""
PLOT_FILE = "loss.png"

Outcome = Literal["finished", "stopped", "failed"]
"""How a run ended: trained to the end | stopped by SIGTERM or Ctrl-C (to be resumed) | an error."""


class Sink(Protocol):
    """One destination of the metrics records (called from one background thread only)."""

    name: str

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        """One record: the metrics of optimizer step `step`, of `kind` train or val."""

    def close(self, outcome: Outcome) -> None:
        """Write what is buffered and end (a tracker marks its run finished, stopped or failed)."""


@dataclass(frozen=True)
class Tracker:
    """A sink started in the background (it may wait on the network): `start()` returns it or raises."""

    name: str
    start: Callable[[], Sink]


def scalars(metrics: Mapping[str, Any], kind: str) -> dict[str, float]:
    """A record's finite numbers, named `<kind>/<key>` (train/loss, val/val_loss) as in TensorBoard and trackers."""
    return {
        f"{kind}/{key}": float(value)
        for key, value in metrics.items()
        if isinstance(value, (int, float)) and math.isfinite(value)
    }


class JsonlSink:
    """metrics.jsonl: one JSON object per record, `{"kind": ..., "step": ..., **metrics}`, flushed at once."""

    name = "metrics.jsonl"

    def __init__(self, path: Path) -> None:
        self._file = open_file(path, "a", encoding="utf-8")

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        self._file.write(json.dumps({"kind": kind, "step": step, **metrics}) + "\n")
        self._file.flush()

    def close(self, outcome: Outcome) -> None:
        self._file.close()


class TensorBoardSink:
    """<run>/tensorboard/: a record's numbers as one event of scalars `<kind>/<key>`. One event per record, not one
    per scalar (SummaryWriter.add_scalar's way), costs a ninth of the CPU time (about 0.1 ms for 17 scalars here),
    which the training process's other thread would otherwise take from the step."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        self._summary, self._value = Summary, Summary.Value
        self._writer = FileWriter(str(make_dirs(run_dir, "tensorboard")))

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        values = [self._value(tag=tag, simple_value=value) for tag, value in scalars(metrics, kind).items()]
        self._writer.add_summary(self._summary(value=values), step)

    def close(self, outcome: Outcome) -> None:
        self._writer.close()


class _Feeder:
    """Sinks fed in order from a queue by one daemon thread. Files (no `trackers`): a record that a file cannot
    take is lost, with one error for the run. Trackers: each is started in the thread, and one that fails to
    start or to write is dropped with one warning."""

    def __init__(self, name: str, files: Sequence[Sink], trackers: Sequence[Tracker], where: str) -> None:
        self.sinks, self.where, self.tracking = list(files), where, bool(trackers)
        self.names = [s.name for s in files] + [t.name for t in trackers]
        self.lost = 0  # records a file could not take
        self._outcome: Outcome = "finished"
        self._queue: queue.SimpleQueue[tuple[int, dict[str, float], str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._drain, args=(trackers,), name=name, daemon=True)
        self._thread.start()

    def put(self, step: int, metrics: dict[str, float], kind: str) -> None:
        self._queue.put((step, metrics, kind))

    def close(self, outcome: Outcome, patience_s: float = 0.0, limit_s: float | None = None) -> None:
        """Write everything queued, close the sinks; wait for the thread (saying so after `patience_s`), at most
        `limit_s` (None: until it is done), after which it is left behind, with a warning."""
        self._outcome = outcome
        self._queue.put(None)
        if patience_s:
            self._thread.join(patience_s)
            if self._thread.is_alive():
                log.info("waiting for %s to finish sending the metrics", " and ".join(self.names))
        self._thread.join(limit_s)
        if self._thread.is_alive():
            log.warning(
                "gave up waiting for %s after %g s: the last metrics of this run may be missing there",
                " and ".join(self.names),
                limit_s,
            )

    def _drain(self, trackers: Sequence[Tracker]) -> None:
        for tracker in trackers:
            try:
                self.sinks.append(tracker.start())
            except Exception as e:  # not installed, a bad URI, no network, no login: the run goes on without it
                self._warn(tracker.name, "did not start, so it receives no metrics of this run", e)
        while (record := self._queue.get()) is not None:
            for sink in list(self.sinks):
                try:
                    sink.write(*record)
                except Exception as e:  # a full disk or a dead tracker must not kill training; say so, once
                    if self.tracking:
                        self.sinks.remove(sink)
                        self._warn(sink.name, "failed and receives no further metrics of this run", e)
                        continue
                    self.lost += 1
                    if self.lost == 1:
                        log.error("could not write a metrics record to %s: %s (training goes on)", self.where, e)
                    break  # the record is lost either way
        for sink in self.sinks:
            try:
                sink.close(self._outcome)
            except Exception as e:
                log.warning("could not close the %s metrics sink: %s: %s", sink.name, type(e).__name__, _first_line(e))

    def _warn(self, tracker: str, what: str, error: Exception) -> None:
        log.warning(
            "the %s tracker %s (training goes on; the metrics are in %s): %s: %s",
            tracker,
            what,
            self.where,
            type(error).__name__,
            _first_line(error),
        )


def _first_line(error: Exception) -> str:
    """The start of an error's message, to log, without credentials: a tracker's errors quote its URL whole
    (MLFLOW_TRACKING_URI may hold user info or a token); redacted before it is cut, so no cut hides a URL's end."""
    text = redact(str(error)).strip()
    return text.splitlines()[0][:500] if text else ""


class MetricsWriter:
    """Rank 0's metrics: metrics.jsonl always, TensorBoard unless `tensorboard=False`, and `trackers` (wandb, mlflow:
    trackers.py), each written from a background thread. `write` returns at once."""

    def __init__(self, run_dir: Path, tensorboard: bool = True, trackers: Sequence[Tracker] = ()) -> None:
        self.run_dir = run_dir
        files: list[Sink] = [JsonlSink(run_dir / METRICS_FILE)]  # its failure to open stops the run (setup.py)
        if tensorboard:
            try:
                files.append(TensorBoardSink(run_dir))
            except ImportError:  # tensorboard is a declared dependency; keep training if it was removed
                log.warning("tensorboard is not installed; metrics go to %s only", METRICS_FILE)
        where = str(run_dir / METRICS_FILE)
        self._files = _Feeder("trainmesh-metrics", files, (), where)
        self._trackers = _Feeder("trainmesh-trackers", (), trackers, where) if trackers else None
        self._closed = False

    def write(self, step: int, metrics: dict[str, float], kind: str = "train") -> None:
        """Queue one record (returns at once)."""
        self._files.put(step, metrics, kind)
        if self._trackers is not None:
            self._trackers.put(step, metrics, kind)

    def close(self, outcome: Outcome = "finished") -> None:
        """Write everything queued, close the files, draw the loss curve, and end the trackers' runs (as finished,
        stopped or failed). A second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._files.close(outcome)
        if self._files.lost:
            log.error("%d metrics record(s) could not be written to %s", self._files.lost, self.run_dir)
        try:
            plot_losses(self.run_dir / METRICS_FILE, self.run_dir / PLOT_FILE)
        except OSError as e:
            log.error("could not finish the metrics files in %s: %s", self.run_dir, e)
        if self._trackers is not None:  # last: a tracker may take a while to upload what it buffered
            # bounded: a tracker server that does not answer must not hold the ranks past their stop window (a
            # preempted job has seconds) or past the collective timeout of the barrier that follows
            self._trackers.close(outcome, patience_s=5.0, limit_s=TRACKER_CLOSE_S[outcome])


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
