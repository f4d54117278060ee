"""Files under a run folder: every path stays inside it and nothing is written through a symlink. Whole folders are
committed by rename; `--force` replaces only a folder trainmesh wrote (`FolderOwner`).

Details: docs/internals.md#corefilespy
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger

log = get_logger(__name__)


class UnsafePathError(UserError, OSError):
    """A path under a run folder is, or passes through, a symlink or something else than expected."""


class JsonFileError(ValueError):
    """A JSON file that cannot be read or parsed (`read_json`); its message names the file and says why, for the
    caller to put in its own one-line error."""


def make_dirs(root: Path, *parts: str) -> Path:
    """`root/parts...`, each part a real directory inside `root` (all created when missing)."""
    root.mkdir(parents=True, exist_ok=True)
    path = root
    for part in parts:
        assert part and part not in (".", "..") and "/" not in part, part
        path = path / part
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise UnsafePathError(
                f"{path} is {'a symlink' if path.is_symlink() else 'not a directory'}; trainmesh creates files under "
                "a run folder only in real directories inside it. Fix: remove it (or point run.out_dir elsewhere)."
            )
        path.mkdir(exist_ok=True)
    return path


def make_new_dir(parent: Path, base: str, limit: int = 10_000) -> Path | None:
    """`parent/base`, else `base-2`, `base-3`...: the first name that is free, created here (mkdir fails on
    anything already there, a planted symlink included), so no other process takes it. None when `limit`
    names are taken."""
    for n in range(1, limit + 1):
        folder = parent / (base if n == 1 else f"{base}-{n}")
        with contextlib.suppress(FileExistsError):
            folder.mkdir()
            return folder
    return None


_FLAGS = {
    "r": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND,
}
NEW_FILE_MODE = 0o666
"""What a new file is created with, less the umask: as `open()`, `touch` and the shell make files, so that the
user's umask alone decides who may read and write trainmesh's files."""


def open_file(path: Path, mode: str = "r", *, flags: int = 0, **kwargs: Any) -> IO[Any]:
    """`open(path, mode)` that refuses a symlink at `path` (modes r, w, a, x, a+, each optionally with b);
    `flags`: more of os.open's."""
    flags |= _FLAGS[mode.replace("b", "")] | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, NEW_FILE_MODE)
    except OSError:
        if path.is_symlink():
            raise UnsafePathError(
                f"{path} is a symlink; trainmesh does not read or write through symlinks in a run folder. "
                "Fix: remove it (or point run.out_dir elsewhere)."
            ) from None
        raise
    return os.fdopen(fd, mode, **kwargs)


def write_atomically(path: Path, data: str | bytes, durable: bool = False) -> None:
    """Replace `path` as a whole: write a fresh temporary file, (fsync it,) rename it into place."""

    def write(tmp: Path) -> None:
        with open_file(tmp, "wb") as f:  # the file replace_file created, never a symlink's target
            f.write(data.encode() if isinstance(data, str) else data)

    replace_file(path, write, durable)


def replace_file(path: Path, write: Callable[[Path], None], durable: bool = False) -> None:
    """Replace `path` as a whole with the file `write(tmp)` writes at a fresh temporary path beside it, for a
    writer that takes a file name (safetensors' `save_file`). Such a writer may make a file of its own and
    rename it over `tmp` (safetensors' is mode 0600), so the file is given the mode a new file gets here."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of this pid; unlink never follows a symlink
    try:
        with open_file(tmp, "xb") as f:  # created here, so that the writer writes to no symlink's target
            mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)  # NEW_FILE_MODE less the umask
        write(tmp)
        with open_file(tmp, "rb") as f:  # whatever file is at `tmp` now, never a symlink's target
            os.fchmod(f.fileno(), mode)
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if durable:
        fsync_dir(path.parent)


def read_bytes(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of `path`, refusing a symlink; longer files, and anything but a regular file (a FIFO
    planted there would block the read forever), raise ValueError."""
    with open_file(path, "rb", flags=os.O_NONBLOCK) as f:  # O_NONBLOCK: opening a FIFO does not wait
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise ValueError(f"{path} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{path} is larger than {limit} bytes")
    return bytes(data)


def read_json(path: Path, limit: int) -> Any:
    """The JSON value in `path`, read by `read_bytes` (at most `limit` bytes of a regular file, never through a
    symlink); JsonFileError for anything that stops it, so that a caller handles one exception."""
    try:
        data = read_bytes(path, limit)
    except UnsafePathError:
        raise JsonFileError(f"{path} is a symlink, which is not read") from None
    except OSError as e:  # missing, no permission, ...
        raise JsonFileError(f"{path} cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # not a regular file, or too large: the message names the file
        raise JsonFileError(str(e)) from None
    try:
        return json.loads(data)
    except RecursionError:  # Python's parser recurses once a level: 100,000 '[' exhaust it
        raise JsonFileError(f"{path} holds JSON nested too deeply to read") from None
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise JsonFileError(f"{path} is not JSON ({e})") from None


def is_plain_name(name: object) -> bool:
    """Whether `name`, read from a file someone else may have written, is a str naming an entry of a folder itself:
    not empty, '.' or '..', not absolute, no folder part, and no NUL byte (which no path can hold)."""
    return isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..") and "\0" not in name


def fsync_dir(folder: Path) -> None:
    """Make a rename or new entry in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class FolderOwner:
    """A command that writes a folder as a whole and, with --force, replaces only a folder it wrote: an empty one,
    or one holding its marker file (prepare's manifest.json) and only the files that marker lists."""

    command: str
    """as the user types it, e.g. `trainmesh data prepare`"""
    marker: str
    written: Callable[[Path], set[str] | None]
    """the names of the files the command wrote into a folder, its marker included, as the folder's marker lists
    them; None when the folder holds no marker of the command's"""
    error: type[UserError]
    """what a refusal raises: the command's own error"""
    label: str = "{path}"
    """how a refusal names the folder (`path`): as the flag that gave it, e.g. `--out={path!r}`"""
    other: str = "another folder"
    """the fix that avoids it, e.g. `another --out`"""
    unmarked_note: str = ""
    """added where a refusal says a folder has no marker, e.g. that the command's older versions wrote none"""


def check_replaceable(folder: Path, owner: FolderOwner) -> None:
    """Refuse (`owner.error`) to replace `folder` unless it is empty or only what `owner` wrote there; a folder
    that does not exist, or a symlink (replaced as a link, its target untouched), may be replaced."""
    if not os.path.lexists(folder) or folder.is_symlink():
        return
    if os.path.ismount(folder):  # a bind mount, say: the output is committed by a rename, which cannot replace it
        raise owner.error(
            f"{owner.label.format(path=str(folder))} is a mount point: {owner.command} writes a complete folder beside "
            f"it and renames it into place, which cannot replace a mount point. Fix: {owner.other} (a folder inside "
            f"it, e.g. {str(folder / 'out')!r})."
        )
    _refuse_foreign(folder, folder, owner)


def _refuse_foreign(folder: Path, shown: Path, owner: FolderOwner) -> set[str]:
    """The names `owner` wrote into `folder` (the folder at `shown`), all of its entries; refuses any other."""
    label = owner.label.format(path=str(shown))
    if not folder.is_dir() or folder.is_symlink():
        raise owner.error(f"{label} is a file, not a folder, so it is not replaced. Fix: {owner.other}.")
    present = sorted(os.listdir(folder))
    ours = owner.written(folder) if present else set()
    # A listed name that is a folder is not one of the command's files (they are all plain files).
    others = present if ours is None else [n for n in present if n not in ours or (folder / n).is_dir()]
    if not others:
        return set(present)
    shown_names = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    what = (
        f"is not the output of an earlier {owner.command} (it has no {owner.marker} of trainmesh's"
        f"{owner.unmarked_note}) and holds {shown_names}"
        if ours is None
        else f"holds files an earlier {owner.command} did not write ({shown_names})"
    )
    raise owner.error(
        f"{label} {what}, so it is not replaced, with --force or without: --force replaces only an empty folder "
        f"or an earlier {owner.command}'s output. Fix: {owner.other}, or remove {str(shown)!r} yourself if nothing "
        "in it is needed."
    )


def replace_folder(new: Path, dest: Path, *, replace: bool, owner: FolderOwner | None = None) -> None:
    """Rename the complete folder `new` to `dest`, its sibling, after making `new`'s files and entries durable,
    so that after a power loss `dest` is the old folder or the whole new one, never a part of it.

    Without `replace`, `dest` must not exist (FileExistsError): whatever appeared there since the caller
    checked, another process's output say, is never taken. With it, an existing `dest` is moved aside (a
    folder cannot be renamed over a non-empty one) and checked there against `owner`'s rule: a folder holding
    anything `owner` did not write is put back and refused (`check_replaceable`), whatever was written into
    it since the caller checked. Then `new` is renamed into place (the old one put back if that fails) and
    the old one's files that `owner` wrote are deleted, and the folder only if that leaves it empty. A symlink
    at `dest` is replaced as a link: it is removed, never followed, and the folder it points to left alone. A
    `dest` gone by the time it is to be moved aside (another commit's doing) is nothing to replace."""
    assert owner is not None or not replace, "replacing a folder takes its owner's rule"
    _fsync_tree(new)
    if not replace:
        if os.path.lexists(dest):
            raise FileExistsError(f"{dest} exists")
        # The kernel's rename would still replace an empty folder made in the instant since the check (a
        # non-empty one, or a file, makes it fail): no data can be lost there.
        try:
            os.rename(new, dest)
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):  # something appeared there meanwhile
                raise FileExistsError(f"{dest} exists") from None
            raise
        fsync_dir(dest.parent)
        return
    assert owner is not None
    old = _free_name(dest.with_name(f".{dest.name}.old-{os.getpid()}"))
    written: set[str] = set()
    try:
        os.rename(dest, old)
        moved = True
    except FileNotFoundError:  # nothing there, or gone since the caller looked (another --force committed)
        moved = False
    if moved and not old.is_symlink():
        try:
            written = _refuse_foreign(old, dest, owner)
        except BaseException:
            _put_back(old, dest, owner)
            raise
    try:
        os.rename(new, dest)
    except BaseException:
        if moved:
            _put_back(old, dest, owner)
        raise
    fsync_dir(dest.parent)
    if moved:
        _remove_written(old, written, dest)


def warn_moved_aside(dest: Path) -> None:
    """Warn of each folder that a replacement of `dest` moved aside and left (`replace_folder` killed between its
    renames, still running, or finding files it did not write there): never removed here, as it may hold the only
    copy of the old `dest`, or a user's folder moved aside and not yet checked."""
    for old in sorted(dest.parent.glob(f".{glob.escape(dest.name)}.old-*")):
        log.warning(
            "%s is a folder moved aside while %s was replaced, and left there (that process was killed, still runs, "
            "or found files it had not written in it): look at it, then remove it or move it back",
            old,
            dest,
        )


def _free_name(path: Path) -> Path:
    """`path`, or `path-2`, `path-3`...: the first name with nothing there (a killed process's leftover is
    never removed here: it may be a user's folder moved aside and not yet checked; `warn_moved_aside` names it)."""
    candidate, n = path, 1
    while os.path.lexists(candidate):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _put_back(old: Path, dest: Path, owner: FolderOwner) -> None:
    try:
        os.rename(old, dest)
    except OSError as e:  # something else is at `dest` now: both are kept
        raise owner.error(
            f"{dest} was moved aside to be replaced and cannot be put back ({e.strerror}): something was written "
            f"at {dest} meanwhile. Both are kept: the old folder is now {old}. Fix: move it back yourself once you "
            "have looked at both."
        ) from None


def _remove_written(old: Path, written: set[str], dest: Path) -> None:
    """Delete the files of the old folder that its owner wrote, then the folder if that emptied it: a file
    written into it since it was checked stays, with a warning."""
    try:
        if old.is_symlink():
            old.unlink()
            return
        for name in written:
            (old / name).unlink(missing_ok=True)
        old.rmdir()
    except OSError as e:  # the new folder is in place: what is left is disk space, or files to keep
        why = f"it holds {', '.join(sorted(os.listdir(old))[:5])}" if e.errno == errno.ENOTEMPTY else e.strerror
        log.warning(
            "%s replaced; its old folder, moved to %s, is left there (%s): look, then remove it", dest, old, why
        )


def remove_tree(path: Path) -> None:
    """Delete a file or a folder tree, if there; never follows a symlink (rmtree refuses one, unlink removes
    the link itself)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def _fsync_tree(folder: Path) -> None:
    """fsync every file under `folder` (symlinks are not followed), then each folder, deepest first."""
    for directory, _, files in os.walk(folder, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(directory))
