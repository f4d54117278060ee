"""Integrity of a checkpoint directory: a manifest of every file's size and SHA-256.

The manifest is written last, just before the directory is committed by rename. Verification checks
it before anything in the checkpoint is parsed or unpickled (DCP's `.metadata` is a pickle), so a
flipped byte, a truncated shard or a garbled metadata file is reported and never loaded. Hashing is
spread over the ranks (file i goes to rank i mod world size), so a large checkpoint is hashed in
parallel.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from trainmesh.runtime.runtime import Runtime

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20


@dataclass
class Verdict:
    """Whether a checkpoint can be trusted, and if not, why (one line per problem)."""

    path: Path
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def file_digest(path: Path, fsync: bool = False) -> dict[str, Any]:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
        if fsync:
            os.fsync(f.fileno())  # durable before the commit, whoever wrote it
    return {"size": path.stat().st_size, "sha256": h.hexdigest()}


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _my_share(names: list[str], runtime: Runtime) -> list[str]:
    return names[runtime.rank :: runtime.world_size]


def write_manifest(folder: Path, runtime: Runtime, group: ProcessGroup | None = None) -> None:
    """Collective (over `group`): hash (and fsync) every file in parallel; rank 0 writes the manifest."""
    names = runtime.broadcast_object(_files(folder) if runtime.is_main_process else [], group=group)
    mine = {name: file_digest(folder / name, fsync=True) for name in _my_share(names, runtime)}
    entries: dict[str, Any] = {}
    for part in runtime.all_gather_object(mine, group=group):
        entries.update(part)
    if runtime.is_main_process:
        write_json_durably(folder / MANIFEST, {"format": FORMAT, "files": entries})


def verify(folder: Path, runtime: Runtime | None = None) -> Verdict:
    """Check a checkpoint against its manifest. Collective when `runtime` is given (parallel hashing),
    local otherwise (e.g. `trainmesh ckpt verify`); every rank gets the same verdict."""
    verdict = Verdict(folder)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
        assert manifest["format"] == FORMAT and isinstance(files, dict)
    except FileNotFoundError:
        verdict.problems.append(f"{folder}: no {MANIFEST} (never committed by trainmesh, or written by an old version)")
        return verdict
    except (ValueError, KeyError, TypeError, AssertionError):
        verdict.problems.append(f"{folder / MANIFEST}: garbled")
        return verdict
    names = sorted(files)
    mine = _my_share(names, runtime) if runtime else names
    problems = [p for name in mine if (p := _check_file(folder, name, files[name]))]
    if runtime is not None:
        problems = [p for part in runtime.all_gather_object(problems) for p in part]
    verdict.problems = sorted(problems)
    required = {"trainer_state.json", ".metadata"}
    missing_from_manifest = required - set(names)
    if missing_from_manifest:
        verdict.problems.append(f"{folder}: manifest lacks {sorted(missing_from_manifest)}")
    return verdict


def _check_file(folder: Path, name: str, expected: dict[str, Any]) -> str | None:
    path = folder / name
    if Path(name).is_absolute() or ".." in Path(name).parts or path.is_symlink():
        return f"{folder / MANIFEST}: entry {name!r} points outside the checkpoint (absolute, '..' or a symlink)"
    if not path.is_file():
        return f"{path}: missing"
    if path.stat().st_size != expected["size"]:
        return f"{path}: {path.stat().st_size} bytes, expected {expected['size']} (truncated or extended)"
    actual = file_digest(path)["sha256"]
    if actual != expected["sha256"]:
        return f"{path}: sha256 {actual}, expected {expected['sha256']}"
    return None


def write_json_durably(path: Path, data: Any) -> None:
    """Write JSON under a temporary name, fsync it, and rename it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    fsync_dir(path.parent)


def fsync_dir(folder: Path) -> None:
    """Make a rename or new entry in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
