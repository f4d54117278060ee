"""Files under a run folder: every path stays inside it, and nothing is written through a symlink.

A run folder may live in shared scratch space or be copied from elsewhere, and whoever can write into it
can plant a symlink where trainmesh is about to write (`metrics.jsonl -> ~/.bashrc`) or read
(`checkpoints/latest -> /etc/shadow`). So trainmesh makes and opens files under a run folder only here:

- every directory between the run folder and the file is a real directory, created here if missing (the
  run folder itself may be a symlink: that is where its owner chose to put it);
- files are opened with O_NOFOLLOW, so a symlink at the file's own name is refused (ELOOP);
- a file replaced as a whole is written under a fresh temporary name (O_EXCL) and renamed over the old
  one, which replaces a symlink there instead of writing through it;
- a new file gets the mode any program's new file gets, 0666 less the user's umask (0644 under the usual
  022), also when a library wrote it (`replace_file`).

A folder written as a whole (an export, prepared token shards) is built under a temporary name beside its
destination and committed by `replace_folder`: made durable and renamed into place; an old folder there is
replaced only when asked (and put back if the rename fails), and a symlink there is never followed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger

log = get_logger(__name__)


class UnsafePathError(UserError, OSError):
    """A path under a run folder is, or passes through, a symlink or something else than expected."""


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


def fsync_dir(folder: Path) -> None:
    """Make a rename or new entry in `folder` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_folder(new: Path, dest: Path, *, replace: bool) -> None:
    """Rename the complete folder `new` to `dest`, its sibling, after making `new`'s files and entries durable,
    so that after a power loss `dest` is the old folder or the whole new one, never a part of it.

    Without `replace`, `dest` must not exist (FileExistsError): whatever appeared there since the caller
    checked, another process's output say, is never taken. With it, an existing `dest` is moved aside (a
    folder cannot be renamed over a non-empty one), `new` renamed into place and the old one removed; if that
    rename fails the old one is put back, so a failure loses nothing. A symlink at `dest` is replaced as a
    link: it is removed, never followed, and the folder it points to is left alone."""
    _fsync_tree(new)
    if not replace:
        if os.path.lexists(dest):
            raise FileExistsError(f"{dest} exists")
        # The kernel's rename would still replace an empty folder made in the instant since the check (a
        # non-empty one, or a file, makes it fail): no data can be lost there.
        os.rename(new, dest)
        fsync_dir(dest.parent)
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    remove_tree(old)  # a leftover of a killed process that had this pid
    moved = os.path.lexists(dest)
    if moved:
        os.rename(dest, old)
    try:
        os.rename(new, dest)
    except BaseException:
        if moved:
            os.rename(old, dest)
        raise
    fsync_dir(dest.parent)
    try:
        remove_tree(old)
    except OSError as e:  # the new folder is in place: what is left is only disk space
        log.warning("%s replaced, but the old one, moved to %s, could not be removed (%s): remove it", dest, old, e)


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
