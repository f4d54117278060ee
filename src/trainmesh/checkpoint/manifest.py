"""Integrity of a checkpoint directory: a manifest of every file's size and SHA-256, written last, verified before
anything is parsed, hashed in parallel over the ranks.

Details: docs/internals.md#checkpointmanifestpy
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainmesh.core.files import read_bytes, write_atomically

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from trainmesh.runtime.runtime import Runtime

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 1 << 20
_MAX_MANIFEST_BYTES = 256 * 2**20
_SHA256 = re.compile(r"[0-9a-f]{64}")


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


class PeerFailed(OSError):
    """Another rank's part of a collective step failed; that rank reports the error."""


def write_manifest(folder: Path, runtime: Runtime, group: ProcessGroup | None = None) -> None:
    """Collective (over `group`): hash (and fsync) every file in parallel; rank 0 writes the manifest.
    A rank's failure (a full disk at fsync, say) is raised there, and PeerFailed on every other rank,
    after the same collectives."""
    listing: tuple[list[str], OSError | None] = ([], None)
    if runtime.is_main_process:
        try:
            listing = (_files(folder), None)
        except OSError as e:
            listing = ([], e)
    names, error = runtime.broadcast_object(listing, group=group)
    if error is not None and not runtime.is_main_process:
        error = PeerFailed("rank 0 could not list the files to hash")
    mine: dict[str, Any] = {}
    if error is None:
        try:
            mine = {name: file_digest(folder / name, fsync=True) for name in _my_share(names, runtime)}
        except OSError as e:
            error = e
    parts = runtime.all_gather_object((mine, error is not None), group=group)
    if error is not None:
        raise error
    if any(failed for _, failed in parts):
        raise PeerFailed("another rank could not hash its files")
    entries = {name: digest for part, _ in parts for name, digest in part.items()}
    if runtime.is_main_process:
        _write_entries(folder, entries)


def write_manifest_here(folder: Path) -> None:
    """`write_manifest` in one process, without a process group (offline tools: `trainmesh ckpt upgrade`)."""
    _write_entries(folder, {name: file_digest(folder / name, fsync=True) for name in _files(folder)})


def _write_entries(folder: Path, entries: dict[str, Any]) -> None:
    write_json_durably(folder / MANIFEST, {"format": FORMAT, "files": entries})


def verify(folder: Path, runtime: Runtime | None = None) -> Verdict:
    """Check a checkpoint against its manifest. Collective when `runtime` is given (parallel hashing),
    local otherwise (e.g. `trainmesh ckpt verify`); every rank gets the same verdict."""
    verdict = Verdict(folder)
    try:
        files = _read_manifest(folder)
    except FileNotFoundError:
        verdict.problems.append(f"{folder}: no {MANIFEST} (never committed by trainmesh, or written by an old version)")
        return verdict
    except (OSError, ValueError) as e:
        verdict.problems.append(f"{folder / MANIFEST}: garbled ({e})")
        return verdict
    names = sorted(files)
    mine = _my_share(names, runtime) if runtime else names
    problems = [p for name in mine if (p := _check_file(folder, name, files[name]))]
    if runtime is None or runtime.is_main_process:
        problems += _unlisted(folder, set(names))
    if runtime is not None:
        problems = [p for part in runtime.all_gather_object(problems) for p in part]
    verdict.problems = sorted(problems)
    required = {"trainer_state.json", ".metadata"}
    missing_from_manifest = required - set(names)
    if missing_from_manifest:
        verdict.problems.append(f"{folder}: manifest lacks {sorted(missing_from_manifest)}")
    return verdict


def file_matches(folder: Path, name: str) -> bool:
    """Whether one file of a checkpoint matches its manifest entry (cheap: that file alone is hashed)."""
    try:
        entry = _read_manifest(folder).get(name)
    except (OSError, ValueError):
        return False
    return entry is not None and _check_file(folder, name, entry) is None


def _read_manifest(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifest's entries, each checked: a relative name, a size, a SHA-256 (ValueError otherwise)."""
    try:
        manifest = json.loads(read_bytes(folder / MANIFEST, _MAX_MANIFEST_BYTES))
    except RecursionError:  # brackets nested deeper than Python's stack: garbled like any other non-manifest
        raise ValueError("nested too deeply to be a manifest") from None
    if not (
        isinstance(manifest, dict) and manifest.get("format") == FORMAT and isinstance(manifest.get("files"), dict)
    ):
        raise ValueError(f"not a format-{FORMAT} manifest")
    for name, entry in manifest["files"].items():
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("size"), int)
            and not isinstance(entry["size"], bool)
            and entry["size"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _SHA256.fullmatch(entry["sha256"])
        ):
            raise ValueError(f"entry {name[:200]!r} is not {{'size': <bytes>, 'sha256': <64 hex digits>}}")
    return dict(manifest["files"])


def _check_file(folder: Path, name: str, expected: dict[str, Any]) -> str | None:
    path = folder / name
    try:
        if Path(name).is_absolute() or ".." in Path(name).parts or _through_symlink(folder, path):
            return f"{folder / MANIFEST}: entry {name!r} points outside the checkpoint (absolute, '..' or a symlink)"
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != expected["size"]:
            return f"{path}: {path.stat().st_size} bytes, expected {expected['size']} (truncated or extended)"
        actual = file_digest(path)["sha256"]
    except OSError as e:  # unreadable, a name too long, ...: a problem of this checkpoint, not of the run
        return f"{folder / MANIFEST}: entry {name[:200]!r} cannot be checked ({e.strerror or e})"
    if actual != expected["sha256"]:
        return f"{path}: sha256 {actual}, expected {expected['sha256']}"
    return None


def _unlisted(folder: Path, names: set[str]) -> list[str]:
    """What lies in the checkpoint folder besides the manifest's files: a symlink anywhere (never
    followed), or a file the manifest does not list (it would be read unchecked)."""
    problems = []
    for root, dirs, files in os.walk(folder):  # does not descend into symlinked directories
        for entry in [*dirs, *files]:
            path = Path(root) / entry
            name = str(path.relative_to(folder))
            if path.is_symlink():
                problems.append(f"{path}: a symlink inside the checkpoint")
            elif path.is_file() and name not in names and name != MANIFEST:
                problems.append(f"{path}: not in {MANIFEST} (added after the commit)")
    return problems


def _through_symlink(folder: Path, path: Path) -> bool:
    """Whether `path` or a directory between `folder` and it is a symlink."""
    while path != folder:
        if path.is_symlink():
            return True
        path = path.parent
    return False


def write_json_durably(path: Path, data: Any) -> None:
    """Write JSON under a temporary name, fsync it, and rename it into place."""
    write_atomically(path, json.dumps(data, indent=1), durable=True)
