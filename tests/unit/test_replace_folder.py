"""core/files.py `replace_folder`, the one commit of a folder written as a whole (an export, prepared token
shards): nothing is replaced without `replace`, and with it only a folder its owner wrote (checked once moved
aside, and only its files deleted); a failed rename puts the old folder back, a symlink is replaced as a link,
and everything is fsynced before the rename."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from trainmesh.core import files
from trainmesh.core.errors import UserError
from trainmesh.core.files import FolderOwner, check_replaceable, replace_folder


class Refused(UserError):
    pass


def _marked(folder: Path) -> set[str] | None:
    """The files a MARK file lists, and MARK: the test's owner writes MARK last, naming what it wrote."""
    marker = folder / "MARK"
    return {"MARK", *marker.read_text().split()} if marker.is_file() else None


OWNER = FolderOwner(command="test write", marker="MARK", written=_marked, error=Refused)


def folder(path: Path, **contents: str) -> Path:
    path.mkdir()
    for name, text in contents.items():
        (path / name).write_text(text)
    return path


def ours(path: Path, **contents: str) -> Path:
    """A folder the owner wrote: `contents` and a MARK listing them."""
    return folder(path, **contents, MARK=" ".join(contents))


def test_without_replace_nothing_there_is_taken(tmp_path: Path) -> None:
    new = folder(tmp_path / ".new", a="new")
    replace_folder(new, tmp_path / "out", replace=False)
    assert (tmp_path / "out" / "a").read_text() == "new" and not new.exists()
    for existing in (folder(tmp_path / "empty"), folder(tmp_path / "full", b="theirs")):
        new = folder(tmp_path / ".new", a="new")
        with pytest.raises(FileExistsError):
            replace_folder(new, existing, replace=False)  # os.rename alone would replace the empty one
        assert (new / "a").exists() and [p.name for p in existing.iterdir()] == (
            [] if existing.name == "empty" else ["b"]
        )
        (new / "a").unlink()
        new.rmdir()


def test_replace_puts_the_old_folder_back_when_the_rename_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    out = ours(tmp_path / "out", b="old")
    new = folder(tmp_path / ".new", a="new")
    real = os.rename

    def failing(src: str | Path, dst: str | Path) -> None:
        if Path(src) == new:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", failing)
    with pytest.raises(OSError, match="No space left"):
        replace_folder(new, out, replace=True, owner=OWNER)
    assert (out / "b").read_text() == "old" and (new / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new", "out"]
    monkeypatch.setattr(files.os, "rename", real)
    replace_folder(new, out, replace=True, owner=OWNER)
    assert [p.name for p in out.iterdir()] == ["a"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_symlink_is_replaced_as_a_link_and_its_target_left_alone(tmp_path: Path) -> None:
    target = folder(tmp_path / "target", keep="mine")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    replace_folder(folder(tmp_path / ".new", a="new"), link, replace=True, owner=OWNER)
    assert not link.is_symlink() and [p.name for p in link.iterdir()] == ["a"]
    assert (target / "keep").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]


def test_files_and_folders_are_fsynced_before_the_rename(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    new = folder(tmp_path / ".new", a="new")
    (new / "sub").mkdir()
    (new / "sub" / "b").write_text("deeper")
    events: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd)))
    monkeypatch.setattr(os, "rename", lambda src, dst: (events.append(f"rename {src}"), real_rename(src, dst)))
    replace_folder(new, tmp_path / "out", replace=False)
    synced_before = set(events[: events.index(f"rename {new}")])
    assert {str(new / "a"), str(new / "sub" / "b"), str(new / "sub"), str(new)} <= synced_before
    assert events[-1] == str(tmp_path)  # the rename itself, made durable


@pytest.mark.parametrize(
    ("contents", "why"),
    [
        ({"thesis.tex": "mine"}, r"is not the output of an earlier test write \(it has no MARK of trainmesh's\)"),
        ({"MARK": "a", "a": "ours", "notes.txt": "mine"}, r"holds files an earlier test write did not write"),
    ],
)
def test_only_an_empty_folder_or_one_its_owner_wrote_is_replaced(
    tmp_path: Path, contents: dict[str, str], why: str
) -> None:
    """The one rule of --force for data prepare and ckpt export: a folder of the user's files is never deleted."""
    out = folder(tmp_path / "out", **contents)
    new = folder(tmp_path / ".new", a="new")
    message = rf"{out} {why}.*, so it is not replaced, with --force or without"
    with pytest.raises(Refused, match=message):
        check_replaceable(out, OWNER)
    with pytest.raises(Refused, match=message):
        replace_folder(new, out, replace=True, owner=OWNER)
    assert {p.name: p.read_text() for p in out.iterdir()} == contents and (new / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new", "out"]  # put back, nothing else left
    for replaced in (folder(tmp_path / "empty"), ours(tmp_path / "earlier", a="old", b="old")):
        check_replaceable(replaced, OWNER)
        replace_folder(folder(tmp_path / f".{replaced.name}.new", a="new"), replaced, replace=True, owner=OWNER)
        assert {p.name: p.read_text() for p in replaced.iterdir()} == {"a": "new"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new", "earlier", "empty", "out"]


def test_a_file_written_after_the_callers_check_is_never_deleted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """--force deleted a file written into the old folder between the last check and the rename. Written before
    the folder is moved aside, the replacement is refused and the folder put back; written after, into the folder
    moved aside, only the owner's files are deleted from it and it is left with a warning."""
    out = ours(tmp_path / "out", a="old")
    check_replaceable(out, OWNER)
    (out / "notes.txt").write_text("written after the check")
    new = folder(tmp_path / ".new", a="new")
    with pytest.raises(Refused, match=r"out holds files an earlier test write did not write \(notes.txt\)"):
        replace_folder(new, out, replace=True, owner=OWNER)
    assert sorted(p.name for p in out.iterdir()) == ["MARK", "a", "notes.txt"]
    (out / "notes.txt").unlink()

    real = os.rename

    def late(src: str | Path, dst: str | Path) -> None:
        if Path(src) == new:  # the old folder is aside and checked: a write into it lands now
            (next(tmp_path.glob(".out.old-*")) / "late.txt").write_text("mine")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", late)
    with caplog.at_level(logging.WARNING, logger="trainmesh"):
        replace_folder(new, out, replace=True, owner=OWNER)
    (old,) = tmp_path.glob(".out.old-*")
    assert [p.name for p in old.iterdir()] == ["late.txt"] and [p.name for p in out.iterdir()] == ["a"]
    assert f"its old folder, moved to {old}, is left there (it holds late.txt)" in caplog.text


def test_a_folder_gone_before_it_is_moved_aside_is_nothing_to_replace(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two --force commits at once: the other one moved `dest` aside between this one's look and its own move,
    which raised a raw FileNotFoundError."""
    out = ours(tmp_path / "out", a="old")
    new = folder(tmp_path / ".new", a="new")
    real = os.rename

    def raced(src: str | Path, dst: str | Path) -> None:
        if Path(src) == out and Path(dst).name.startswith(".out.old-"):
            real(out, tmp_path / ".out.old-other")  # the other commit's move, just before this one's
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", raced)
    replace_folder(new, out, replace=True, owner=OWNER)
    assert [p.name for p in out.iterdir()] == ["a"] and (out / "a").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.old-other", "out"]  # the other's to finish


def test_a_full_folder_appearing_after_the_check_is_never_taken(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without `replace`: a folder with files made in the instant between the check and the rename was a raw
    ENOTEMPTY; it is FileExistsError, which each command turns into its one-line refusal."""
    new, dest = folder(tmp_path / "new", a="new"), folder(tmp_path / "dest", theirs="kept")
    monkeypatch.setattr(files.os.path, "lexists", lambda path: False)  # the check saw nothing there
    with pytest.raises(FileExistsError):
        replace_folder(new, dest, replace=False)
    assert (dest / "theirs").read_text() == "kept" and (new / "a").is_file()


def test_a_mount_point_is_refused_before_anything_is_written(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A bind-mounted output folder cannot be replaced by a rename: refused up front, naming a folder inside it."""
    mounted = folder(tmp_path / "mnt")
    monkeypatch.setattr(files.os.path, "ismount", lambda path: Path(path) == mounted)
    with pytest.raises(Refused, match=rf"{mounted} is a mount point: .*Fix: another folder \(a folder inside it"):
        check_replaceable(mounted, OWNER)
    check_replaceable(folder(tmp_path / "plain"), OWNER)  # an empty folder that is no mount point may be replaced
