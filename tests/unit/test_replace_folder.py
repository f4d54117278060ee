"""core/files.py `replace_folder`, the one commit of a folder written as a whole (an export, prepared token
shards): nothing is replaced without `replace`, a failed rename puts the old folder back, a symlink is replaced
as a link, and everything is fsynced before the rename."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainmesh.core import files
from trainmesh.core.files import replace_folder


def folder(path: Path, **contents: str) -> Path:
    path.mkdir()
    for name, text in contents.items():
        (path / name).write_text(text)
    return path


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
    out = folder(tmp_path / "out", b="old")
    new = folder(tmp_path / ".new", a="new")
    real = os.rename

    def failing(src: str | Path, dst: str | Path) -> None:
        if Path(src) == new:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(files.os, "rename", failing)
    with pytest.raises(OSError, match="No space left"):
        replace_folder(new, out, replace=True)
    assert (out / "b").read_text() == "old" and (new / "a").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".new", "out"]
    monkeypatch.setattr(files.os, "rename", real)
    replace_folder(new, out, replace=True)
    assert [p.name for p in out.iterdir()] == ["a"] and sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_symlink_is_replaced_as_a_link_and_its_target_left_alone(tmp_path: Path) -> None:
    target = folder(tmp_path / "target", keep="mine")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    replace_folder(folder(tmp_path / ".new", a="new"), link, replace=True)
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
