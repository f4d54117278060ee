"""Build a `Config` from code defaults < a TOML file < dotted `--section.key=value` overrides.

Unknown keys and values of the wrong type are rejected here, naming the key as the user types it and,
for a typo, the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import tomli_w

from trainmesh.config.schema import Config, ModelConfig
from trainmesh.core.errors import UserError

RENAMED = {"run.name": "run.id (on the command line: --run-id)"}  # keys of earlier versions, for the message


class ConfigError(UserError, ValueError):
    """A configuration the user must fix; the message names the key and the fix."""


def parse_override(text: str) -> tuple[str, Any]:
    """`--optim.lr=3e-4` -> ("optim.lr", 0.0003). Values are TOML literals; anything else is a string."""
    body = text[2:] if text.startswith("--") else text
    key, sep, raw = body.partition("=")
    if not sep or not key or "." not in key:
        raise ConfigError(f"override {text!r} must look like --section.key=value (e.g. --optim.lr=3e-4)")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw  # a bare word such as bf16-mixed or a path
    except RecursionError:  # tomllib recurses once per '[' or '{'
        raise ConfigError(f"override {text[:60]!r}...: its value is nested too deeply to be a setting") from None
    return key, value


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist (given with --config)")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from None
    except RecursionError:  # tomllib recurses once per '[' or '{': 100,000 of them exhaust the stack
        raise ConfigError(
            f"config file {str(path)!r} nests arrays or tables too deeply to be a config. Fix: --config a trainmesh "
            "config (see docs/configuration.md)."
        ) from None


def merge_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply dotted overrides onto a nested dict (a copy); later overrides win."""
    merged = _deep_copy(data)
    for text in overrides:
        key, value = parse_override(text)
        node = merged
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: '{part}' is a value, not a section")
            node = child
        node[leaf] = value
    return merged


def deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`base` with `top`'s values on top, section by section (a copy; `top` wins where both set a value)."""
    merged = _deep_copy(base)
    for key, value in top.items():
        below = merged.get(key)
        merged[key] = deep_merge(below if isinstance(below, dict) else {}, value) if isinstance(value, dict) else value
    return merged


def build_config(data: dict[str, Any], model_cls: type[ModelConfig]) -> Config:
    """Turn a nested dict into a validated `Config`; the `[model]` section uses `model_cls`."""
    data = _deep_copy(data)
    model = _build(model_cls, data.pop("model", {}), prefix="model.")
    return typing.cast(Config, _build(Config, data, prefix="", given={"model": model}))


def config_to_dict(config: Any) -> dict[str, Any]:
    return dataclasses.asdict(config)


def dump_toml(data: dict[str, Any]) -> str:
    """A nested dict of scalars as TOML (sections and sub-sections as [a.b] tables), through tomli-w, which
    escapes every string per the TOML spec (control characters included). None values are left out."""
    return tomli_w.dumps(_without_none(data))


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _without_none(v) if isinstance(v, dict) else v for k, v in data.items() if v is not None}


def _deep_copy(data: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in data.items()}


def _build(cls: type[Any], data: Any, prefix: str, given: dict[str, Any] | None = None) -> Any:
    """`cls` from the values in `data` (checked and converted per field) and the sections in `given`."""
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ConfigError(f"'{section}' must be a section (a TOML table), got {data!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)} - set(given or {})
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" Did you mean '{prefix}{close[0]}'?" if close else ""
            if f"{prefix}{key}" in RENAMED:
                hint = f" It was renamed: {RENAMED[prefix + key]}."
            allowed = ", ".join(sorted(prefix + k for k in known))
            raise ConfigError(f"unknown config key '{prefix}{key}'.{hint} Known keys here: {allowed}")
    kwargs = {}
    for key, value in data.items():
        kind = hints[key]
        if dataclasses.is_dataclass(kind):
            kwargs[key] = _build(typing.cast(type, kind), value, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(f"{prefix}{key}", value, kind)
    try:
        return cls(**kwargs, **(given or {}))
    except ValueError as e:  # __post_init__ range checks
        raise ConfigError(str(e)) from None


def _coerce(key: str, value: Any, kind: Any, optional: bool = False) -> Any:
    """Check `value` against the field's type; accept the few safe conversions CLI strings need."""
    origin = typing.get_origin(kind)
    if origin is tuple:  # tuple[X, ...]: a TOML array; frozen sections hold tuples, not lists
        item = typing.get_args(kind)[0]
        if isinstance(value, str):  # --log.sinks=tensorboard,wandb (a bare word), or "" for the empty list
            value = [part.strip() for part in value.split(",") if part.strip()]
        if isinstance(value, (list, tuple)):
            return tuple(_coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value))
        raise ConfigError(f"config key '{key}' expects a list, e.g. --{key}='[\"a\",\"b\"]', got {value!r}")
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(kind)
        unset = isinstance(value, str) and value.lower() in ("none", "auto")  # tri-state: unset means automatic
        if value is None or (unset and type(None) in options):
            return None
        inner = [o for o in options if o is not type(None)]
        return _coerce(key, value, inner[0], optional=type(None) in options)
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)):
            return str(value)
    else:
        raise AssertionError(f"config field {key} has unsupported type {kind}")
    type_name = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[kind]
    if optional:
        type_name += ', or "auto" (unset)'

    raise ConfigError(f"config key '{key}' expects {type_name}, got {value!r} ({type(value).__name__})")
