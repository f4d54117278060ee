"""Experiment trackers, offline: wandb in offline mode (its run files read back record by record) and MLflow on a
file store (read back with MlflowClient). Each gets the resolved config and every record; a resumed run continues
the same tracker run; a tracker that cannot start or fails mid-run costs a warning, never the run."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest

from support import nano_toml, refused_before_writing
from trainmesh.config import ConfigError
from trainmesh.config.loader import config_to_dict
from trainmesh.config.log import LogConfig
from trainmesh.config.schema import Config
from trainmesh.job.spec import load_config
from trainmesh.metrics import trackers as trackers_module
from trainmesh.metrics.sinks import METRICS_FILE, MetricsWriter, Outcome, read_metrics
from trainmesh.metrics.trackers import IDS_FILE, RUN_ID_TAG, check_installed, flatten, read_ids, trackers

CONFIG = Config(log=LogConfig(sinks=("wandb", "mlflow"), project="tm-tests", tags=("nano", "ci")))
FLAT = flatten(config_to_dict(CONFIG))


@pytest.fixture
def caplog(caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> pytest.LogCaptureFixture:
    monkeypatch.setattr(logging.getLogger("trainmesh"), "propagate", True)  # even after a CLI test set it off
    return caplog


def _train(
    run_dir: Path,
    sinks: tuple[str, ...],
    steps: range,
    resumed: bool = False,
    outcome: Outcome = "finished",
    config: Config = CONFIG,
    **log: Any,
) -> None:
    """What the loop does with rank 0's writer: a train record per step, a val record at the last."""
    log_config = LogConfig(sinks=sinks, project="tm-tests", tags=("nano", "ci"), **log)
    started = trackers(log_config, run_dir, run_dir.name, config_to_dict(config), resumed)
    writer = MetricsWriter(run_dir, tensorboard=False, trackers=started)
    for step in steps:
        writer.write(step, {"loss": 10.0 - step, "lr": 1e-3, "grad_norm": float("nan")})
    writer.write(steps[-1], {"val_loss": 7.5}, kind="val")
    writer.close(outcome)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# --- wandb -----------------------------------------------------------------------------------------------------


def wandb_records(path: Path) -> list[Any]:
    """The records of an offline run's `.wandb` file: wandb's LevelDB-style log (a 7-byte header, then 32 KiB
    blocks of chunks with a 7-byte header each: CRC, length, type) of its own protobuf `Record`s. wandb 0.31 has no
    Python reader of these files (its Go core reads them), so the test reads them with wandb's message types."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, block, pending, records = 7, 32 * 1024, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        if pos + 7 + length > len(data):  # the chunk wandb is writing as the file is read: not there yet
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_run(folder: Path) -> dict[str, Any]:
    """An offline run folder's id, name, tags, config, history {step: {key: value}} and exit code."""
    (log_file,) = folder.glob("run-*.wandb")
    # wandb's service process writes the file: run.finish() may return before the records are all there.
    deadline = time.monotonic() + 30
    while not any(r.WhichOneof("record_type") == "exit" for r in wandb_records(log_file)):
        assert time.monotonic() < deadline, f"{log_file} holds no exit record"
        time.sleep(0.1)
    run: dict[str, Any] = {"history": {}, "config": {}}
    for record in wandb_records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.update(id=record.run.run_id, name=record.run.display_name, tags=list(record.run.tags))
            run["config"].update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            run["config"].update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item}
            run["history"].setdefault(record.history.step.num, {}).update(items)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", "")  # empty counts as unset, as before: its files go to <run>/wandb/
    monkeypatch.setenv("WANDB_SILENT", "true")


def _user_keys(history: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in history.items() if not k.startswith("_")}


def test_wandb_gets_the_config_and_every_record_and_a_resume_continues_its_run(
    tmp_path: Path, wandb_offline: None, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = tmp_path / "gpt-exp1"
    run_dir.mkdir()
    _train(run_dir, ("wandb",), range(1, 4), outcome="stopped")
    (first,) = (run_dir / "wandb").glob("offline-run-*")
    run = wandb_run(first)
    assert run["id"].startswith("gpt-exp1-") and run["id"] == read_ids(run_dir)["wandb"]
    assert run["name"] == "gpt-exp1" and run["tags"] == ["nano", "ci"]
    assert {k: v for k, v in run["config"].items() if k != "_wandb"} == FLAT  # every key of the resolved config
    assert run["config"]["log.sinks"] == ["wandb", "mlflow"] and "optim.lr" in run["config"]
    assert {step: _user_keys(h) for step, h in run["history"].items()} == {
        1: {"train/loss": 9.0, "train/lr": 1e-3},  # NaN left out, as in TensorBoard
        2: {"train/loss": 8.0, "train/lr": 1e-3},
        3: {"train/loss": 7.0, "train/lr": 1e-3, "val/val_loss": 7.5},
    }
    assert run["exit_code"] == 0

    _train(run_dir, ("wandb",), range(4, 6), resumed=True)  # from the checkpoint of step 3
    second = next(p for p in (run_dir / "wandb").glob("offline-run-*") if p != first)
    resumed = wandb_run(second)
    assert resumed["id"] == run["id"]  # the same wandb run (offline, wandb writes a folder per process)
    assert sorted(resumed["history"]) == [4, 5]
    assert not _warnings(caplog), _warnings(caplog)

    _train(run_dir, ("wandb",), range(1, 3), resumed=False)  # a new run from step 0 in the same folder
    assert read_ids(run_dir)["wandb"] != run["id"]


def test_wandb_that_fails_to_start_costs_a_warning(
    tmp_path: Path, wandb_offline: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import wandb

    def init(**kwargs: Any) -> None:
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", init)
    _train(tmp_path, ("wandb",), range(1, 4))
    assert [r["step"] for r in read_metrics(tmp_path / METRICS_FILE)] == [1, 2, 3, 3]
    (warning,) = _warnings(caplog)
    assert "the wandb tracker did not start" in warning and "api_key not configured" in warning
    assert not (tmp_path / IDS_FILE).exists()


# --- mlflow ----------------------------------------------------------------------------------------------------


@pytest.fixture
def mlflow_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store for opt-in use only
    return f"file:{tmp_path / 'mlruns'}"


def test_mlflow_gets_the_config_and_every_record_and_a_resume_continues_its_run(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(trackers_module, "_MLFLOW_PARAMS_PER_CALL", 40)  # the config takes several calls
    run_dir = tmp_path / "gpt-exp2"
    run_dir.mkdir()
    _train(run_dir, ("mlflow",), range(1, 4), outcome="stopped", mlflow_tracking_uri=mlflow_store)
    client = MlflowClient(mlflow_store)
    run_id = read_ids(run_dir)["mlflow"]
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.info.run_name == "gpt-exp2"
    assert client.get_experiment(run.info.experiment_id).name == "tm-tests"
    assert run.data.tags[RUN_ID_TAG] == "gpt-exp2" and run.data.tags["nano"] == "" and run.data.tags["ci"] == ""
    params = run.data.params
    assert len(params) == len(FLAT) > 80
    assert params["optim.lr"] == str(CONFIG.optim.lr) and params["log.sinks"] == '["wandb", "mlflow"]'

    def history(key: str) -> list[tuple[int, float]]:
        return [(m.step, m.value) for m in client.get_metric_history(run_id, key)]

    assert history("train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0)] and history("val/val_loss") == [(3, 7.5)]
    assert "train/grad_norm" not in run.data.metrics  # NaN left out

    changed = Config(log=CONFIG.log, optim=type(CONFIG.optim)(lr=1e-3))  # a resume with another learning rate
    _train(run_dir, ("mlflow",), range(4, 6), resumed=True, config=changed, mlflow_tracking_uri=mlflow_store)
    assert read_ids(run_dir)["mlflow"] == run_id
    assert client.get_run(run_id).info.status == "FINISHED"
    assert history("train/loss") == [(1, 9.0), (2, 8.0), (3, 7.0), (4, 6.0), (5, 5.0)]
    assert client.get_run(run_id).data.params["optim.lr"] == str(CONFIG.optim.lr)  # MLflow keeps the first value
    assert not _warnings(caplog), _warnings(caplog)


def test_mlflow_at_a_bad_uri_or_failing_mid_run_costs_one_warning(
    tmp_path: Path, mlflow_store: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    _train(tmp_path / "a", ("mlflow",), range(1, 3), mlflow_tracking_uri="nosuch://tracking")
    (warning,) = _warnings(caplog)
    assert "the mlflow tracker did not start" in warning and "nosuch" in warning
    caplog.clear()

    from mlflow.tracking import MlflowClient

    def broken(self: Any, run_id: str, metrics: Any = (), **kwargs: Any) -> None:
        if metrics:
            raise OSError(28, "No space left on device")
        return real(self, run_id, metrics=metrics, **kwargs)

    real = MlflowClient.log_batch
    monkeypatch.setattr(MlflowClient, "log_batch", broken)
    caplog.set_level(logging.INFO, logger="trainmesh")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"{mlflow_store}?token=s3cret")  # the file store ignores the query
    _train(tmp_path / "b", ("mlflow",), range(1, 5))
    (warning,) = _warnings(caplog)
    assert "the mlflow tracker failed and receives no further metrics" in warning and "No space left" in warning
    assert [r["step"] for r in read_metrics(tmp_path / "b" / METRICS_FILE)] == [1, 2, 3, 4, 4]
    # The variable, unlike log.mlflow_tracking_uri, may hold a credential: the log names the server without it.
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("mlflow: run ") and m.endswith(f" at {mlflow_store}") for m in messages), messages
    assert not [m for m in messages if "s3cret" in m]


def test_mlflow_errors_are_logged_without_the_credentials_of_mlflow_tracking_uri(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """MLflow's errors quote the tracking URL whole: a resume whose run cannot be fetched, then a start that fails
    (nothing listens on port 9; no retries, so it fails at once)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://u:s3cret@127.0.0.1:9/?token=s3cret")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    (tmp_path / IDS_FILE).write_text(json.dumps({"mlflow": "0123abcd"}))
    _train(tmp_path, ("mlflow",), range(1, 3), resumed=True)
    resume, start = _warnings(caplog)
    assert resume.startswith("mlflow: run 0123abcd of trackers.json is not there") and "127.0.0.1:9" in resume
    assert "the mlflow tracker did not start" in start and "API request to http://127.0.0.1:9/" in start
    assert not [m for m in (resume, start) if "s3cret" in m], (resume, start)


# --- before launch ---------------------------------------------------------------------------------------------


def test_a_tracker_package_that_is_missing_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = trackers_module.importlib.util.find_spec
    monkeypatch.setattr(
        trackers_module.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    check_installed(LogConfig(sinks=("tensorboard",)))  # nothing to import
    with pytest.raises(ConfigError) as error:
        check_installed(LogConfig(sinks=("tensorboard", "wandb")))
    message = str(error.value)
    assert "log.sinks names 'wandb', but the wandb package is not installed" in message
    assert "pip install 'trainmesh[wandb]'" in message and """--log.sinks='["tensorboard"]'""" in message


def test_trackers_json_holds_plain_ids_only(tmp_path: Path) -> None:
    (tmp_path / IDS_FILE).write_text(json.dumps({"wandb": "../../etc", "mlflow": "0123abcd", "other": "x"}))
    assert read_ids(tmp_path) == {"mlflow": "0123abcd"}
    for hostile in ("not json", "[" * 5000):  # 5000 nested brackets: a RecursionError in json, at each resume
        (tmp_path / IDS_FILE).write_text(hostile)
        assert read_ids(tmp_path) == {}


# --- credentials -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "found"),
    [
        ("--log.mlflow_tracking_uri=https://s3cret@mlflow.example.com/", "a user name or token"),
        ("--log.mlflow_tracking_uri=https://me:s3cret@mlflow.example.com/", "a password (user:password@"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?token=s3cret", "parameter 'token'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/api?x=1&access_token=s3cret", "'access_token'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?API-KEY=s3cret", "'API-KEY'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?password=s3cret", "'password'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?client_secret=s3cret", "'client_secret'"),
        ("--log.mlflow_tracking_uri=https://store.example.com/m?sv=1&sig=s3cret", "'sig'"),
        ("--log.mlflow_tracking_uri=https://store.example.com/m?X-Amz-Signature=s3cret", "'X-Amz-Signature'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/#access_token=s3cret", "'access_token'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?%74oken=s3cret", "'token'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/api;token=s3cret", "'token'"),  # a path parameter
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?accessToken=s3cret", "'accessToken'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/?bearer=s3cret", "'bearer'"),
        ("--log.mlflow_tracking_uri=https://mlflow.example.com/ui;jsessionid=s3cret", "'jsessionid'"),
        ("--log.run_name=run?jwt=s3cret", "'jwt'"),
        ("--log.project=gpt#session=s3cret", "'session'"),
        ("--log.run_name=https://s3cret@wandb.example.com/", "a user name or token"),
        ("--log.project=gpt?api_key=s3cret", "'api_key'"),
    ],
)
def test_a_credential_in_a_tracker_setting_is_refused_at_load(override: str, found: str) -> None:
    """The config is written to config.toml, every checkpoint and the trackers: refused, never stripped, and the
    message does not repeat the secret."""
    key = override.removeprefix("--").partition("=")[0]
    with pytest.raises(ConfigError) as error:
        load_config(None, [override], "gpt")
    message = str(error.value)
    assert message.startswith(f"{key} holds ") and found in message, message
    assert "s3cret" not in message and "\n" not in message
    if key == "log.mlflow_tracking_uri":
        assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN" in message
    else:
        assert "WANDB_API_KEY" in message and "MLFLOW_TRACKING_TOKEN" in message


def test_the_cli_refuses_a_token_in_the_tracker_uri_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    uri = "--log.mlflow_tracking_uri=https://s3cret@mlflow.example.com:5000/?experiment=2"
    err = refused_before_writing(tmp_path, capsys, "run", "gpt", "--config", str(nano_toml(tmp_path)), "--", uri)
    assert "Fix: --log.mlflow_tracking_uri=https://mlflow.example.com:5000/?experiment=2 and" in err
    assert "s3cret" not in err


@pytest.mark.parametrize(
    "uri",
    [
        "https://mlflow.example.com:5000/path?experiment=1;view=2#runs",
        "http://10.0.0.7:5000",
        "databricks",
        "databricks://my-profile:prefix",
        "file:/shared/mlruns",
        "sqlite:///mlflow.db",
        "postgresql://db.example.com/mlflow?sslmode=require",
        "https://mlflow.example.com/?author=bob&keyword=gpt&tokens=1",  # secret names match as whole words
    ],
)
def test_a_tracker_uri_without_credentials_is_kept_as_written(uri: str) -> None:
    config = load_config(None, [f"--log.mlflow_tracking_uri={uri}", "--log.run_name=gpt #tokens=1B"], "gpt")
    assert config.log.mlflow_tracking_uri == uri and config_to_dict(config)["log"]["mlflow_tracking_uri"] == uri
    assert config.log.run_name == "gpt #tokens=1B"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("mysql://mlflow@db.example.com/mlflow", "mysql://db.example.com/mlflow"),
        ("postgresql+psycopg2://me:s3cret@db:5432/mlflow", "postgresql+psycopg2://db:5432/mlflow"),
    ],
)
def test_a_database_store_with_its_login_in_the_uri_gets_a_fix_that_works_for_it(uri: str, shown: str) -> None:
    """MLflow reads a database's login from the URI only, never from MLFLOW_TRACKING_USERNAME/PASSWORD."""
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"--log.mlflow_tracking_uri={uri}"], "gpt")
    message = str(error.value)
    assert "MLflow reads a database store's user and password from its URI only" in message, message
    assert "in the MLFLOW_TRACKING_URI variable" in message and f"--log.mlflow_tracking_uri={shown} with" in message
    assert "MLFLOW_TRACKING_USERNAME" not in message and "s3cret" not in message and "\n" not in message
