"""The `[log]` section: where rank 0 sends the metrics besides `<run>/metrics.jsonl` (TensorBoard and experiment
trackers). Its own module because schema.py is long enough; `Config.log` is this class."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from urllib.parse import unquote_plus

SINKS = ("tensorboard", "wandb", "mlflow")
TRACKERS = ("wandb", "mlflow")
"""The sinks that are experiment trackers: optional packages, started on rank 0, never fatal to the run."""
TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._/:=+-]{0,63}")  # what both wandb (64 chars) and MLflow accept
CREDENTIAL_VARIABLES = {
    "mlflow": "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN",
    "wandb": "WANDB_API_KEY, or the key `wandb login` saved",
}
"""Where each tracker reads its credentials from: never the config, which trainmesh writes to config.toml, every
checkpoint's trainer_state.json, the trackers and the logs."""
_URI = re.compile(r"([^?#]*)(?:\?([^#]*))?(?:#(.*))?", re.DOTALL)  # before ?, the query, the fragment
_USER_INFO = re.compile(r"(?<=//)[^/]*@")  # user@ or user:password@ before the host
_USER_INFO_IN_TEXT = re.compile(r"(?<=//)[^/\s]*@")  # the same in a message, where a space ends the URL
_PATH_PARAMETER = re.compile(r";([^/;]*)")  # /path;token=x: a parameter of a path segment
_WORD_IN_TEXT = re.compile(r"[^\s'\"()<>]*[?#;][^\s'\"()<>]*")  # a word of a message that may hold parameters
_SECRET_WORDS = frozenset(
    {"auth", "authorization", "apikey", "accesskey", "privatekey", "secretkey", "key", "sig", "signature"}
    | {"credential", "credentials", "pwd", "pass", "bearer", "jwt", "session", "sessionid", "jsessionid", "sessionkey"}
)
_SECRET_ENDINGS = ("token", "secret", "password", "passwd")
"""Parameter names that carry a credential, matched against each word of the name (split at -_. and between
camelCase words, lower case), whole: ?token=, access_token, accessToken, api_key, X-Amz-Signature, Azure's sig,
Google's key; but not author or tokens (a run name "x #tokens=1B")."""
_DATABASE_STORES = re.compile(r"(postgresql|mysql|mssql|sqlite)(\+\w+)?://", re.IGNORECASE)
"""MLflow's SQLAlchemy stores, which read the database user and password from the URI only."""


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
        for key, trackers in (("mlflow_tracking_uri", ("mlflow",)), ("project", TRACKERS), ("run_name", TRACKERS)):
            _refuse_credentials(f"log.{key}", getattr(self, key), trackers)
        bad = [t for t in self.tags if not TAG.fullmatch(t)]
        if bad:
            raise ValueError(
                f"log.tags: {bad[0]!r} is not a tag: 1 to 64 letters, digits, spaces and ._/:=+- starting with a "
                "letter or digit (e.g. --log.tags='[\"baseline\"]')"
            )


def credentials_in(uri: str) -> list[str]:
    """What in `uri` is a credential: its user info, and path, query or fragment parameters named like a secret."""
    head, query, fragment = _split(uri)
    found = []
    user = _USER_INFO.search(head)
    if user:
        found.append("a password (user:password@ before the host)" if ":" in user.group() else "a user name or token")
    for item in _PATH_PARAMETER.findall(head) + _items(query) + _items(fragment):
        if _is_secret(item):
            found.append(f"a secret-looking parameter {_name(item)!r}")
    return found


def without_credentials(uri: str) -> str:
    """`uri` without its user info and secret-looking parameters, to show or log; the rest as it was."""
    head, query, fragment = _split(uri)
    shown = _PATH_PARAMETER.sub(lambda m: "" if _is_secret(m.group(1)) else m.group(), _USER_INFO.sub("", head))
    for mark, part in (("?", query), ("#", fragment)):
        kept = [item for item in _items(part) if not _is_secret(item)]
        if part is not None and len(kept) == len(_items(part)):
            shown += mark + part  # nothing removed: as written (; separators, an empty query)
        elif kept:
            shown += mark + "&".join(kept)
    return shown


def redact(text: str) -> str:
    """`text` (an error message) without the credentials of the URLs in it, to log: a tracker's errors quote its
    URL whole, and MLFLOW_TRACKING_URI, unlike the config, may hold user info or a token."""
    text = _USER_INFO_IN_TEXT.sub("", text)
    return _WORD_IN_TEXT.sub(lambda m: without_credentials(m.group()), text)


def _split(uri: str) -> tuple[str, str | None, str | None]:
    """What comes before ?, the query, the fragment (None where there is no ? or #)."""
    match = _URI.fullmatch(uri)
    assert match is not None  # every string matches
    return match.group(1), match.group(2), match.group(3)


def _items(part: str | None) -> list[str]:
    return re.split(r"[&;]", part) if part else []


def _name(item: str) -> str:
    return unquote_plus(item.partition("=")[0])


def _is_secret(item: str) -> bool:
    camel_split = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", _name(item))  # accessToken -> access_Token
    words = re.split(r"[^a-z0-9]+", camel_split.lower())
    return any(word in _SECRET_WORDS or word.endswith(_SECRET_ENDINGS) for word in words)


def _refuse_credentials(key: str, value: str, trackers: tuple[str, ...]) -> None:
    """Refuse, rather than strip, a credential in a tracker setting: the config is the record of the run."""
    found = credentials_in(value)
    if not found:
        return
    problem = (
        f"{key} holds {' and '.join(found)}: the config is written to config.toml, every checkpoint, the trackers "
        "and the logs, so it may hold no credential."
    )
    if _DATABASE_STORES.match(value):
        raise ValueError(
            f"{problem} MLflow reads a database store's user and password from its URI only. Fix: leave {key} empty "
            "and give the URI in the MLFLOW_TRACKING_URI variable (trainmesh neither records nor logs its "
            f"credentials), or --{key}={without_credentials(value)} with the database's own login (PostgreSQL: "
            "PGUSER and ~/.pgpass), or an MLflow tracking server in front of the database."
        )
    where = "; ".join(f"{name} reads {CREDENTIAL_VARIABLES[name]}" for name in trackers)
    raise ValueError(
        f"{problem} Fix: --{key}={without_credentials(value)} and the credentials in the environment: {where}."
    )
