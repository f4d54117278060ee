"""Each rank's own file of a checkpoint (`rng/rank_<r>.pt`: its RNG states and strategy state), read as untrusted
input; and the error for any checkpoint file that holds what trainmesh never writes. Free of DCP, whose import costs
a second: a run that has no checkpoint to read or write never imports it (checkpoint/reader.py reads DCP's files).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch

from trainmesh.core.errors import UserError
from trainmesh.core.files import open_file

RANK_DIR = "rng"  # of a checkpoint: rank_<r>.pt, each rank's RNG states and strategy state
_MALFORMED = (
    OSError,
    EOFError,
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    RuntimeError,
    OverflowError,
)
"""What torch.load, NumPy and Python raise for a truncated file or a malformed value in a rank file. Not MemoryError
or KeyboardInterrupt: they say nothing about the file, and must not get a good checkpoint set aside as corrupt."""
_FD_PATHS = Path("/proc/self/fd")


class UntrustedCheckpointError(UserError, ValueError):
    """A checkpoint file holds something a trainmesh checkpoint never does (code, or a path outside it)."""


def read_rank_file(file: Path, mapped: bool = False) -> dict[str, Any]:
    """A rank's RNG file, loaded with weights_only=True and checked to be what a save writes: RNG states that
    torch, NumPy and Python accept, and a dict of strategy state. UntrustedCheckpointError naming the file
    otherwise, so that the checkpoint is set aside rather than crash a resume halfway. `mapped`: map the file
    instead of reading it, to check it: its tensors are then read only where looked at (the RNG states, a few KiB),
    not the strategy state, as large as the gradients with PowerSGD."""
    try:
        with open_file(file, "rb") as f:  # refuses a symlink
            state = _load_rank_file(f, mapped)
        _check_rank_state(state)
    except pickle.UnpicklingError as e:
        raise UntrustedCheckpointError(f"{file}: refused, {_first_line(e)}") from None
    except _MALFORMED as e:
        what = f"{type(e).__name__}: {_first_line(e)}"
        raise UntrustedCheckpointError(f"{file}: not the RNG state trainmesh writes ({what})") from None
    return state


def _load_rank_file(f: IO[bytes], mapped: bool) -> Any:
    if mapped and _FD_PATHS.is_dir():
        try:  # torch maps a file by name only; this name is the file opened above, whatever the path holds by now
            return torch.load(_FD_PATHS / str(f.fileno()), map_location="cpu", weights_only=True, mmap=True)
        except _MALFORMED:  # or a file system that cannot map files, or torch's older format: judged as read below
            f.seek(0)
    return torch.load(f, map_location="cpu", weights_only=True)


def _check_rank_state(state: Any) -> None:
    """Raise unless `state` is `rng_state()`'s output with a strategy dict. Each RNG state is set on a generator of
    its own, which validates it as the process-wide one would, leaving this process's streams untouched."""
    if not isinstance(state, dict):
        raise TypeError(f"a {type(state).__name__}, expected a dict")
    if not isinstance(state.get("strategy", {}), dict):
        raise TypeError(f"strategy is a {type(state['strategy']).__name__}, expected a dict")
    torch.Generator().set_state(state["torch"])
    if not isinstance(state["cuda"], list) or not all(_is_byte_tensor(t) for t in state["cuda"]):
        raise TypeError("cuda is not a list of byte tensors")
    np.random.RandomState().set_state(as_numpy_state(state["numpy"]))
    random.Random().setstate(as_python_state(state["python"]))


def _is_byte_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8


def as_numpy_state(saved: list[Any]) -> tuple[Any, ...]:
    """A rank file's NumPy state (its keys a tensor, for weights_only) as np.random.set_state takes it."""
    kind, keys, pos, has_gauss, gauss = saved
    return (kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)


def as_python_state(saved: list[Any]) -> tuple[Any, ...]:
    """A rank file's Python state (a tensor, for weights_only) as random.setstate takes it."""
    version, py_state, py_gauss = saved
    return (version, tuple(int(x) for x in py_state.tolist()), py_gauss)


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [""])[0]
