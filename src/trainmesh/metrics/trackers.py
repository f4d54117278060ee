"""Experiment trackers as metrics sinks: Weights & Biases and MLflow, on rank 0 (the `[log]` section). A resumed run
continues its tracker runs; a failing tracker is dropped, never the run.

Details: docs/internals.md#metricstrackerspy
"""

from __future__ import annotations

import importlib.util
import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from trainmesh.config.loader import ConfigError
from trainmesh.config.log import TRACKERS, LogConfig, redact, without_credentials
from trainmesh.core.env import read_var
from trainmesh.core.files import read_bytes, write_atomically
from trainmesh.core.logging import get_logger
from trainmesh.metrics.sinks import Outcome, Sink, Tracker, scalars

log = get_logger(__name__)

IDS_FILE = "trackers.json"
RUN_ID_TAG = "trainmesh.run_id"
"""The MLflow tag that names the trainmesh run (for a search, and for the reader of a tracker run)."""
PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
"""The module each tracker imports (the trainmesh extra of the same name installs it; mlflow-skinny is enough)."""
_SAFE_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")
_MLFLOW_PARAMS_PER_CALL = 100  # MLflow's log_batch limit
_MLFLOW_PARAM_CHARS = 6000  # MLflow's longest parameter value
_MLFLOW_STATUS = {"finished": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


def check_installed(log_config: LogConfig) -> None:
    """Refuse, before anything is launched, a tracker in log.sinks whose package this Python cannot import."""
    for name in (s for s in log_config.sinks if s in TRACKERS):
        if importlib.util.find_spec(PACKAGES[name]) is None:
            raise ConfigError(
                f"log.sinks names {name!r}, but the {PACKAGES[name]} package is not installed in this Python "
                f"({sys.executable}). Fix: pip install 'trainmesh[{name}]', or leave {name} out of log.sinks "
                f"(--log.sinks='{json.dumps([s for s in log_config.sinks if s != name], separators=(',', ':'))}')."
            )


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as flat dotted keys: {"optim": {"lr": 3e-4}} -> {"optim.lr": 3e-4}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def trackers(
    log_config: LogConfig, run_dir: Path, run_id: str, config: Mapping[str, Any], resumed: bool
) -> list[Tracker]:
    """The trackers log.sinks names, ready to start. `config`: the resolved config (nested); `resumed`: the run
    continues from a checkpoint, so it continues the tracker runs named in trackers.json too."""
    flat = flatten(config)
    ids = read_ids(run_dir) if resumed else {}
    starts: dict[str, Callable[[], Sink]] = {
        "wandb": partial(WandbSink.start, log_config, run_dir, run_id, flat, ids.get("wandb")),
        "mlflow": partial(MlflowSink.start, log_config, run_dir, run_id, flat, ids.get("mlflow")),
    }
    return [Tracker(name, starts[name]) for name in log_config.sinks if name in TRACKERS]


def read_ids(run_dir: Path) -> dict[str, str]:
    """The tracker run ids kept in `<run>/trackers.json`; ids that are not plain names are ignored (the file is
    in a folder others may write to, and its ids go into URLs and queries)."""
    path = run_dir / IDS_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_bytes(path, 64 * 1024))
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: a file of nested brackets
        log.warning("ignoring %s (%s): the trackers start new runs", path, e)
        return {}
    if not isinstance(data, dict):
        return {}
    return {k: v for k, v in data.items() if k in TRACKERS and isinstance(v, str) and _SAFE_ID.fullmatch(v)}


def save_id(run_dir: Path, tracker: str, run_id: str) -> None:
    """Record a tracker run's id for a resume (rank 0's tracker thread only: no other writer)."""
    ids = read_ids(run_dir)
    ids[tracker] = run_id
    write_atomically(run_dir / IDS_FILE, json.dumps(ids, indent=2, sort_keys=True) + "\n")


class WandbSink:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self._run = run

    @classmethod
    def start(
        cls, log_config: LogConfig, run_dir: Path, run_id: str, config: dict[str, Any], resume_id: str | None
    ) -> WandbSink:
        import wandb

        # Run ids are unique per project: the trainmesh run id alone could meet another machine's run of the same
        # name, so a random suffix; a resume reads the id back from trackers.json.
        wandb_id = resume_id or f"{re.sub(r'[^A-Za-z0-9_-]', '-', run_id)[:48]}-{secrets.token_hex(4)}"
        where = None if read_var("WANDB_DIR") else str(run_dir)  # <run>/wandb/, unless the user chose
        run = wandb.init(
            project=log_config.project,
            name=log_config.run_name or run_id,
            id=wandb_id,
            resume="allow",  # continue the run with this id if it exists (a resume), else create it
            tags=list(log_config.tags) or None,
            config=config,
            allow_val_change=True,  # a resume may change a few values (checkpoint.resume, train.max_steps)
            reinit="create_new",  # never finish, or log into, a run the caller of a library train() has open
            dir=where,
        )
        save_id(run_dir, cls.name, run.id)
        log.info("wandb: run %s in project %s", run.id, log_config.project)
        return cls(run)

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        self._run.log(scalars(metrics, kind), step=step)

    def close(self, outcome: Outcome) -> None:
        if outcome == "stopped":
            self._run.mark_preempting()  # shown as preempted, to be resumed, not as crashed
        self._run.finish(exit_code=1 if outcome == "failed" else 0)


class MlflowSink:
    """Through an `MlflowClient` of its own, not mlflow's module-level active run: a library caller's run is
    left alone."""

    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        self._client, self.run_id = client, run_id

    @classmethod
    def start(
        cls, log_config: LogConfig, run_dir: Path, run_id: str, config: dict[str, Any], resume_id: str | None
    ) -> MlflowSink:
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        client = MlflowClient(log_config.mlflow_tracking_uri or None)
        run = None
        if resume_id:
            try:
                run = client.get_run(resume_id)
                client.update_run(resume_id, status="RUNNING")
            except MlflowException as e:  # deleted, or another tracking URI than the first launch's
                why = redact(str(e))  # it may quote the tracking URI, credentials and all
                log.warning("mlflow: run %s of %s is not there (%s); starting a new one", resume_id, IDS_FILE, why)
                run = None
        if run is None:
            experiment = client.get_experiment_by_name(log_config.project)
            experiment_id = experiment.experiment_id if experiment else client.create_experiment(log_config.project)
            tags = {RUN_ID_TAG: run_id, **dict.fromkeys(log_config.tags, "")}
            run = client.create_run(experiment_id, run_name=log_config.run_name or run_id, tags=tags)
        mlflow_id = run.info.run_id
        # Parameters cannot change once logged: a resumed run keeps the first launch's values and adds new keys.
        logged = run.data.params
        params = [Param(k, _param_value(v)) for k, v in config.items() if k not in logged]
        changed = [k for k, v in config.items() if k in logged and logged[k] != _param_value(v)]
        if changed:
            log.info("mlflow: run %s keeps its first parameters for %s (config.toml has today's)", mlflow_id, changed)
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_CALL):
            client.log_batch(mlflow_id, params=params[i : i + _MLFLOW_PARAMS_PER_CALL])
        save_id(run_dir, cls.name, mlflow_id)
        where = without_credentials(client.tracking_uri)  # MLFLOW_TRACKING_URI, unlike the config, may hold some
        log.info("mlflow: run %s in experiment %s at %s", mlflow_id, log_config.project, where)
        return cls(client, mlflow_id)

    def write(self, step: int, metrics: Mapping[str, float], kind: str) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        values = [Metric(key, value, now_ms, step) for key, value in scalars(metrics, kind).items()]
        self._client.log_batch(self.run_id, metrics=values)

    def close(self, outcome: Outcome) -> None:
        self._client.set_terminated(self.run_id, _MLFLOW_STATUS[outcome])


def _param_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, list) else str(value)
    return text[:_MLFLOW_PARAM_CHARS]
