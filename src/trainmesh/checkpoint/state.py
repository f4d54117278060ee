"""`trainer_state.json`: everything besides tensors that a resume needs, every value checked for type and range when it
is read.

Details: docs/internals.md#checkpointstatepy
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainmesh.core.errors import UserError
from trainmesh.core.files import read_bytes

TRAINER_STATE = "trainer_state.json"
MAX_STEP = 10**12  # far beyond any real run; a larger step is damage, not progress
_MAX_BYTES = 64 * 2**20  # a trainer state is a few KiB; refuse to read a file that is not one


class InvalidTrainerState(UserError, ValueError):
    """trainer_state.json is missing, unreadable, or holds a value of the wrong type or range."""


@dataclass
class TrainerState:
    """Everything besides tensors that a resume needs."""

    step: int = 0
    """Optimizer steps completed."""
    samples_seen: int = 0
    """Samples consumed over all ranks."""
    world_size: int = 1
    global_batch: int = 0
    """Samples per optimizer step when saved (0: not recorded, by versions before it was)."""
    data_epoch: int = 0
    data_offset: int = 0
    """The data position after `step`: samples of epoch `data_epoch`'s order consumed (data/sharding.py)."""
    precision: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, data: Any) -> TrainerState:
        """Validate decoded JSON; raises InvalidTrainerState naming the first bad value."""
        if not isinstance(data, dict):
            raise InvalidTrainerState(f"a {type(data).__name__}, expected an object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidTrainerState(f"unknown keys {unknown}")
        for key in ("step", "samples_seen", "world_size"):
            if key not in data:
                raise InvalidTrainerState(f"no {key!r}")
        limits = {"world_size": (1, 10**7), "step": (0, MAX_STEP)}
        for key in ("step", "samples_seen", "world_size", "global_batch", "data_epoch", "data_offset"):
            value = data.get(key, 0 if key != "world_size" else 1)
            low, high = limits.get(key, (0, MAX_STEP * 2**32))
            if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
                raise InvalidTrainerState(f"{key} is {value!r}, expected an integer from {low} to {high}")
        for key in ("precision", "config", "versions"):
            if not isinstance(data.get(key, {}), dict):
                raise InvalidTrainerState(f"{key} is a {type(data[key]).__name__}, expected an object")
        if not all(isinstance(v, str) for v in data.get("versions", {}).values()):
            raise InvalidTrainerState("versions holds a value that is not a string")
        if not all(_is_scalar(v) for v in _leaves(data.get("precision", {}))):
            raise InvalidTrainerState("precision holds a value that is not a number, string or boolean")
        return cls(**data)

    @classmethod
    def read(cls, folder: Path) -> TrainerState:
        """The validated trainer state of the checkpoint in `folder` (the file is never followed as a symlink)."""
        path = folder / TRAINER_STATE
        try:
            return cls.from_dict(json.loads(read_bytes(path, _MAX_BYTES)))
        except InvalidTrainerState as e:
            raise InvalidTrainerState(f"{path}: {e}") from None
        except (OSError, ValueError, RecursionError) as e:  # missing, a symlink, too large, not JSON, too deep
            raise InvalidTrainerState(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    return [value]


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (int, float, str, bool))
