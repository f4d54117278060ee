"""What a resume starts from: the run's own recorded config with the command line on top, checked before launch
against what the run's newest checkpoint holds.

Details: docs/internals.md#jobresumepy
"""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmesh.checkpoint.catalog import list_checkpoints
from trainmesh.checkpoint.state import InvalidTrainerState, TrainerState
from trainmesh.config import Config, ConfigError
from trainmesh.config.loader import config_to_dict, load_toml, merge_overrides, parse_override
from trainmesh.config.schema import RunConfig
from trainmesh.core.files import read_bytes
from trainmesh.core.logging import get_logger
from trainmesh.job.rundir import CONFIG_FILE, DECIDED_BY_EACH_LAUNCH, MAX_CONFIG_BYTES
from trainmesh.job.spec import load_config
from trainmesh.recipes import get_recipe

log = get_logger(__name__)

_UNSET = object()


@dataclass(frozen=True)
class RunStart:
    """The config a launch runs, and when it continues a recorded run, what it continues from."""

    config: Config
    run_dir: Path | None = None
    """The run folder continued (None: a new run, or one with nothing recorded yet)."""
    recorded_in: Path | None = None
    """The file whose config the run continues: its config.toml, or a checkpoint's trainer state."""
    changes: tuple[str, ...] = ()
    """The keys the command changes, as "key: old -> new"."""
    step: int = 0
    """The newest checkpoint's step (0: none)."""

    @property
    def finished(self) -> bool:
        """The newest checkpoint is at (or past) train.max_steps: resuming would train nothing."""
        return self.step > 0 and self.step >= self.config.train.max_steps

    def describe(self) -> str:
        """One log line: what the run continues from and what the command changes."""
        assert self.run_dir is not None and self.recorded_in is not None
        where = f"from step {self.step}" if self.step else "(no checkpoint yet)"
        changed = "; the command changes " + ", ".join(self.changes) if self.changes else ", unchanged"
        return f"run {self.run_dir.name} continues {where} with its own config ({self.recorded_in}){changed}"


def load_run_config(
    path: str | Path | None,
    overrides: list[str],
    recipe: str | None = None,
    *,
    auto_resume: bool = False,
    run_dir: Path | None = None,
) -> RunStart:
    """The config of a command line: `trainmesh.job.spec.load_config`'s, except that a resume (checkpoint.resume from
    --resume or an override, or `auto_resume`) of a run with a recorded config starts from that config, with the
    --config file and the overrides on top. `run_dir`: the run's folder where the caller knows it (the worker's
    --run-dir), else <run.out_dir>/<run.id>. Raises ConfigError for a change its newest checkpoint cannot load."""
    command = merge_overrides(load_toml(path) if path else {}, overrides)
    run, checkpoint = (_section(command, name) for name in ("run", "checkpoint"))
    asked = _is_true(checkpoint.get("resume", False))
    if run_dir is None and run.get("id") not in (None, ""):
        run_dir = Path(str(run.get("out_dir", RunConfig.out_dir))) / str(run["id"])
    if not (asked or auto_resume) or run_dir is None or not run_dir.is_dir():  # a missing one is refused when taken
        return RunStart(load_config(path, overrides, recipe))
    newest = _newest_trainer_state(run_dir)
    recorded = _recorded_config(run_dir, newest)
    # Nothing recorded: a new run. --auto-resume reruns the same command, so until the run has a checkpoint to
    # continue (an attempt that failed before its first), the command's config is the run's.
    if recorded is None or (newest is None and not asked):
        return RunStart(load_config(path, overrides, recipe))
    record, recorded_in = recorded
    saved_recipe = _section(record, "run").get("recipe")
    if recipe and saved_recipe and saved_recipe != recipe:
        raise ConfigError(
            f"run {run_dir.name} trains the {saved_recipe!r} recipe ({recorded_in}), not {recipe!r}. "
            f"Fix: trainmesh run {saved_recipe} --resume --run-id {run_dir.name}."
        )
    base = _known_keys(_without(record, DECIDED_BY_EACH_LAUNCH), recipe or str(saved_recipe or "gpt"), recorded_in)
    try:
        config = load_config(path, overrides, recipe, base=base)
    except ConfigError as e:
        if "set on the command line" in str(e) or str(e).startswith("config file"):
            raise  # the command's own key: the message names it
        raise ConfigError(  # the record's value
            f"{e} [resuming run {run_dir.name} from {recorded_in}: correct it there, or set the key on the command "
            "line]"
        ) from None
    origin = _Origin(path, command, overrides)
    if newest is not None:
        check_loadable(config, *newest, origin)
    changes = tuple(_changes(record, config_to_dict(config)))
    return RunStart(config, run_dir, recorded_in, changes, newest[1].step if newest else 0)


def check_loadable(config: Config, checkpoint: Path, saved: TrainerState, origin: _Origin | None = None) -> None:
    """Refuse (ConfigError, every key with both values) a config whose pinned keys differ from the checkpoint's."""
    pins = ("run.recipe", *get_recipe(config.run.recipe).checkpoint_pins)
    ours = config_to_dict(config)
    problems = []
    for key in pins:
        theirs, now = _get(saved.config, key), _get(ours, key)
        if theirs is not _UNSET and theirs != now:
            where = origin.of(key) if origin else ""
            problems.append(f"  {key}: the checkpoint has {theirs!r}, this command gives {now!r}{where}")
    if problems:
        raise ConfigError(
            f"{checkpoint} cannot be loaded with this config (it holds tensors and token ids made for the run's "
            "own values):\n" + "\n".join(problems) + "\nFix: leave these keys out (a resume keeps the run's own "
            f"values), or start a new run under another --run-id than {checkpoint.parent.parent.name}."
        )


def check_resumable(config: Config, run_dir: Path) -> None:
    """Refuse, before anything starts, a resume of `run_dir` whose config its newest checkpoint cannot load (for
    callers with a config of their own, Ray Train's driver; the CLI's load_run_config checks as it loads)."""
    newest = _newest_trainer_state(run_dir) if config.checkpoint.resume else None
    if newest is not None:
        check_loadable(config, *newest)


@dataclass(frozen=True)
class _Origin:
    """Where the command line set a key: for the message that refuses it."""

    path: str | Path | None
    command: dict[str, Any]
    overrides: list[str]

    def of(self, key: str) -> str:
        if key in {parse_override(o)[0] for o in self.overrides}:
            return f" (--{key}=... on the command line)"
        if self.path and _get(self.command, key) is not _UNSET:
            return f" (set in --config {self.path})"
        return " (derived from the keys the command sets)"


def _section(table: dict[str, Any], name: str) -> dict[str, Any]:
    """A section of a raw config, {} when it is missing or not a table (the loader names that error)."""
    section = table.get(name, {})
    return section if isinstance(section, dict) else {}


def _is_true(value: Any) -> bool:
    """As the loader reads a boolean (`--checkpoint.resume=True` is true too)."""
    return value is True or (isinstance(value, str) and value.lower() == "true")


def _known_keys(record: dict[str, Any], recipe: str, recorded_in: Path) -> dict[str, Any]:
    """`record` without the keys and sections this trainmesh does not have (a config.toml written by another
    version), each named in a warning: they cannot be set, and the run's other keys still describe it."""
    try:
        model = get_recipe(recipe).model_config_cls
    except ValueError:
        return record  # an unknown recipe: the loader says so
    dropped: list[str] = []
    kept = _keep_known(record, Config, "", dropped, {"model": model})
    if dropped:
        log.warning("%s: keys this trainmesh does not know, left out: %s", recorded_in, ", ".join(dropped))
    return kept


def _keep_known(
    table: dict[str, Any], cls: type[Any], prefix: str, dropped: list[str], sections: dict[str, type[Any]] | None = None
) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kept: dict[str, Any] = {}
    for key, value in table.items():
        kind = (sections or {}).get(key) or (hints[key] if key in names else None)
        if kind is None:
            dropped.append(f"{prefix}{key}")
        elif dataclasses.is_dataclass(kind):
            if isinstance(value, dict):
                kept[key] = _keep_known(value, kind, f"{prefix}{key}.", dropped)
            else:
                dropped.append(f"{prefix}{key} (not a section)")
        else:
            kept[key] = value
    return kept


def _newest_trainer_state(run_dir: Path) -> tuple[Path, TrainerState] | None:
    """The newest committed checkpoint whose trainer state reads (its tensors are verified where they load)."""
    for checkpoint in reversed(list_checkpoints(run_dir)):
        try:
            return checkpoint, TrainerState.read(checkpoint)
        except InvalidTrainerState as e:
            log.warning("%s: passed over when resuming (%s)", checkpoint, e)
    return None


def _recorded_config(run_dir: Path, newest: tuple[Path, TrainerState] | None) -> tuple[dict[str, Any], Path] | None:
    """The run's config.toml, else the config its newest checkpoint records; None when neither is there."""
    path = run_dir / CONFIG_FILE
    try:
        return tomllib.loads(read_bytes(path, MAX_CONFIG_BYTES).decode()), path
    except FileNotFoundError:
        pass
    except (OSError, ValueError, RecursionError) as e:  # a symlink, too large, not UTF-8, not TOML, nested deep
        log.warning("%s is unreadable (%s): using the config its newest checkpoint records", path, e)
    if newest is not None and newest[1].config:
        return newest[1].config, newest[0]
    return None


def _changes(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """ "key: old -> new" for every key whose value differs (a key missing on one side is None there)."""
    old, new = _flat(before), _flat(after)
    skipped = set(DECIDED_BY_EACH_LAUNCH)
    return [
        f"{key}: {old.get(key)!r} -> {new.get(key)!r}"
        for key in sorted(old.keys() | new.keys())
        if key not in skipped and old.get(key) != new.get(key)
    ]


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def _get(table: dict[str, Any], key: str) -> Any:
    node: Any = table
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def _without(table: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    """A copy of `table` without the dotted `keys`."""
    flat = {k: v for k, v in _flat(table).items() if k not in keys}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = nested
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested
