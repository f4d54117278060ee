"""The `[log]` section: where rank 0 sends the metrics besides `<run>/metrics.jsonl` (TensorBoard and experiment
trackers). Its own module because schema.py is long enough; `Config.log` is this class."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

SINKS = ("tensorboard", "wandb", "mlflow")
TRACKERS = ("wandb", "mlflow")
"""The sinks that are experiment trackers: optional packages, started on rank 0, never fatal to the run."""
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._/:=+-]{0,63}")  # what both wandb (64 chars) and MLflow accept


@dataclass(frozen=True)
class LogConfig:
    sinks: tuple[str, ...] = ("tensorboard",)
    """Where metrics go besides <run>/metrics.jsonl (always written): any of tensorboard | wandb | mlflow, e.g.
    ["tensorboard", "wandb"] (on the command line: --log.sinks='["tensorboard","wandb"]' or tensorboard,wandb); []
    for metrics.jsonl only. wandb and mlflow run on rank 0; one that fails costs a warning, never the run."""
    project: str = "trainmesh"
    """wandb: the project; mlflow: the experiment (created if missing)."""
    run_name: str = ""
    """The tracker run's display name; empty: the run id."""
    tags: tuple[str, ...] = ()
    """Tags of the tracker run (wandb tags; MLflow tags with an empty value), e.g. ["baseline", "gpt-tiny"]."""
    verbose: bool = False
    """Also show the whole resolved config on the console as the run starts (it is always in <run>/config.toml)."""
    mlflow_tracking_uri: str = ""
    """MLflow's tracking server or store (http://host:5000, databricks, file:/path); empty: MLflow's own default
    (the MLFLOW_TRACKING_URI variable, else sqlite:///mlflow.db in the working directory, which needs the full
    mlflow package, not mlflow-skinny)."""

    def __post_init__(self) -> None:
        unknown = [s for s in self.sinks if s not in SINKS]
        if unknown:
            close = difflib.get_close_matches(unknown[0], SINKS, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"log.sinks={list(self.sinks)} names {unknown[0]!r}, which is not a metrics sink.{hint} Choose any of: "
                f"{', '.join(SINKS)} (metrics.jsonl is always written). Fix: e.g. "
                '--log.sinks=\'["tensorboard","wandb"]\''
            )
        if len(set(self.sinks)) != len(self.sinks):
            raise ValueError(f"log.sinks={list(self.sinks)} names a sink twice; name each once")
        if not self.project.strip():
            raise ValueError("log.project is empty: give the wandb project / MLflow experiment, e.g. --log.project=gpt")
        if urlsplit(self.mlflow_tracking_uri).password is not None:
            raise ValueError(
                "log.mlflow_tracking_uri holds a password (user:password@host); the config is written to the run "
                "folder, the trackers and the logs. Fix: the URI without it, and the credentials in "
                "MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN)."
            )
        bad = [t for t in self.tags if not TAG.fullmatch(t)]
        if bad:
            raise ValueError(
                f"log.tags: {bad[0]!r} is not a tag: 1 to 64 letters, digits, spaces and ._/:=+- starting with a "
                "letter or digit (e.g. --log.tags='[\"baseline\"]')"
            )
