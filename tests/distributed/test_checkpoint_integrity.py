"""A checkpoint is valid or it is ignored, never half-loaded: damage of every kind is detected from the
manifest before anything is parsed, reported, moved aside, and the run falls back to the previous
checkpoint and still finishes bit for bit like the undamaged run."""

from __future__ import annotations

import errno
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from support import train_rank
from trainmesh.checkpoint import list_checkpoints, manifest, verify
from trainmesh.checkpoint.catalog import LATEST, checkpoint_root
from trainmesh.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow

RUN = [
    "--train.micro_batch=8",
    "--train.global_batch=8",
    "--train.max_steps=6",
    "--checkpoint.every=3",
    "--checkpoint.final=true",
]


def _flip_byte(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _truncate(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])


DAMAGE: dict[str, tuple[Callable[[Path], None], str]] = {
    "flipped byte in a shard": (_flip_byte, "sha256"),
    "truncated shard": (_truncate, "truncated or extended"),
    "garbled DCP metadata (a pickle)": (lambda c: (c / ".metadata").write_bytes(b"\x80garbage"), ".metadata"),
    "garbled trainer state": (lambda c: (c / "trainer_state.json").write_text("{"), "trainer_state.json"),
    "garbled manifest": (lambda c: (c / "manifest.json").write_text("[1, 2"), "manifest.json: garbled"),
    "missing RNG file": (lambda c: (c / "rng" / "rank_0.pt").unlink(), "missing"),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("integrity")
    (result,) = run_distributed(train_rank, 1, args=(str(root), [*RUN, "--run.id=ref"]))
    assert [p.name for p in list_checkpoints(root / "runs" / "ref")] == ["step_00000003", "step_00000006"]
    return root, result["params"]


def _damaged_copy(root: Path, name: str, damage: Callable[[Path], None]) -> Path:
    run_dir = root / "runs" / name
    shutil.copytree(root / "runs" / "ref", run_dir)
    damage(run_dir / "checkpoints" / "step_00000006")
    return run_dir


@pytest.mark.parametrize("what", list(DAMAGE))
def test_damage_is_detected_and_the_run_falls_back(
    what: str, reference: tuple[Path, dict], capfd: pytest.CaptureFixture[str]
) -> None:
    root, ref_params = reference
    damage, evidence = DAMAGE[what]
    name = "d" + str(list(DAMAGE).index(what))
    run_dir = _damaged_copy(root, name, damage)
    (result,) = run_distributed(train_rank, 1, args=(str(root), [*RUN, f"--run.id={name}", "--checkpoint.resume=true"]))
    log = capfd.readouterr().err
    assert "failed verification" in log and evidence in log
    assert re.search(r"resumed from \S*step_00000003", log)
    assert (run_dir / "checkpoints" / "step_00000006.corrupt").is_dir()  # kept as evidence, never loaded
    assert verify(run_dir / "checkpoints" / "step_00000006").ok  # re-saved after training steps 4-6 again
    for key, value in ref_params.items():
        assert torch.equal(result["params"][key], value), key


def test_damage_to_a_file_that_rank_1_checks_is_found_in_a_2_rank_resume(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Verification is spread over the ranks (file i to rank i mod 2): rank 1's findings count as much as
    rank 0's."""
    two = [*RUN, "--train.micro_batch=4"]
    (reference, _) = run_distributed(train_rank, 2, args=(str(tmp_path), [*two, "--run.id=ref"]))
    shutil.copytree(tmp_path / "runs" / "ref", tmp_path / "runs" / "hit")
    ckpt = tmp_path / "runs" / "hit" / "checkpoints" / "step_00000006"
    names = sorted(json.loads((ckpt / "manifest.json").read_text())["files"])
    damaged = ckpt / names[1]  # the first file rank 1 hashes
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    (resumed, _) = run_distributed(
        train_rank, 2, args=(str(tmp_path), [*two, "--run.id=hit", "--checkpoint.resume=true"])
    )
    log = capfd.readouterr().err
    assert f"{damaged}: sha256" in log and re.search(r"resumed from \S*step_00000003", log), log[-2000:]
    for key, value in reference["params"].items():
        assert torch.equal(resumed["params"][key], value), key


def test_abort_policy_stops_with_the_path(reference: tuple[Path, dict]) -> None:
    root, _ = reference
    _damaged_copy(root, "abort", _flip_byte)
    overrides = [*RUN, "--run.id=abort", "--checkpoint.resume=true", "--checkpoint.on_corrupt=abort"]
    expected = r"(?s)step_00000006 failed verification.*sha256.*on_corrupt=fallback"
    with pytest.raises(DistributedTestError, match=expected):
        run_distributed(train_rank, 1, args=(str(root), overrides))


def test_pointer_and_leftovers(reference: tuple[Path, dict], capfd: pytest.CaptureFixture[str]) -> None:
    root, ref_params = reference
    run_dir = _damaged_copy(root, "pointer", lambda c: None)
    (checkpoint_root(run_dir) / LATEST).write_text("step_99999999\n")  # dangling
    leftover = checkpoint_root(run_dir) / ".step_00000009.tmp"  # a save that never committed
    leftover.mkdir()
    (result,) = run_distributed(train_rank, 1, args=(str(root), [*RUN, "--run.id=pointer", "--checkpoint.resume=true"]))
    log = capfd.readouterr().err
    assert "garbled or dangling" in log and re.search(r"resumed from \S*step_00000006", log)
    assert not leftover.exists()
    for key, value in ref_params.items():
        assert torch.equal(result["params"][key], value), key


def test_rotation_keeps_the_newest_and_touches_nothing_else(tmp_path: Path) -> None:
    root = checkpoint_root(tmp_path / "runs" / "rot")
    (root / "notes").mkdir(parents=True)  # not ours
    outside = tmp_path / "precious"
    outside.mkdir()
    (root / "step_00000000").symlink_to(outside, target_is_directory=True)  # looks like ours, is a link
    overrides = [*RUN, "--checkpoint.every=1", "--checkpoint.keep_last=2", "--run.id=rot"]
    run_distributed(train_rank, 1, args=(str(tmp_path), overrides))
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "rot")] == ["step_00000005", "step_00000006"]
    assert (root / "notes").is_dir() and outside.is_dir() and (root / "step_00000000").is_symlink()


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_before_training(tmp_path: Path) -> None:
    first = [*RUN, "--train.max_steps=3", "--run.id=twice", "--train.micro_batch=4"]
    run_distributed(train_rank, 2, args=(str(tmp_path), first))
    committed = tmp_path / "runs" / "twice" / "checkpoints" / "step_00000003"
    before = (committed / "manifest.json").read_text()
    metrics = (tmp_path / "runs" / "twice" / "metrics.jsonl").read_text()
    with pytest.raises(DistributedTestError, match=r"(?s)already holds step_00000003.*starts at step 0.*--resume"):
        run_distributed(train_rank, 2, args=(str(tmp_path), first))  # a fresh run into the same directory
    assert (committed / "manifest.json").read_text() == before and verify(committed).ok
    assert (tmp_path / "runs" / "twice" / "metrics.jsonl").read_text() == metrics  # refused before any step


def failing_save_rank(rank: int, root: str, where: str) -> dict[str, Any]:
    """`train_rank`, with rank 1's part of every save failing: at the manifest's fsync (a full disk shows up
    there on NFS or under quotas), or in torch.save (which raises a RuntimeError on a full disk)."""
    if rank == 1 and where == "manifest":
        real = manifest.file_digest

        def digest(path: Path, fsync: bool = False) -> dict[str, Any]:
            if fsync:
                raise OSError(errno.ENOSPC, "No space left on device", str(path))
            return real(path, fsync)

        manifest.file_digest = digest  # type: ignore[assignment]
    elif rank == 1:

        def save(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("basic_ios::clear: iostream error")

        torch.save = save  # type: ignore[assignment]
    return train_rank(rank, root, [*RUN, "--train.micro_batch=4", f"--run.id={where}"])


@pytest.mark.parametrize("where", ["manifest", "torch.save"])
def test_a_failure_in_any_part_of_a_save_stops_every_rank_alike(tmp_path: Path, where: str) -> None:
    with pytest.raises(DistributedTestError, match=r"saving checkpoint \S*step_00000003 failed on rank\(s\) \[1\]"):
        run_distributed(failing_save_rank, 2, args=(str(tmp_path), where), timeout_s=60)
    checkpoints = checkpoint_root(tmp_path / "runs" / where)
    assert not list(checkpoints.iterdir())  # nothing committed, the staging folder removed


def _escape_via_manifest(ckpt: Path) -> None:
    """A manifest entry that names a file outside the checkpoint (with its true hash)."""
    import json

    from trainmesh.checkpoint.manifest import file_digest

    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["../../config.toml"] = file_digest(ckpt.parents[1] / "config.toml")  # the run's own file
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _symlinked_file(ckpt: Path) -> None:
    """A listed file replaced by a symlink to an identical copy elsewhere (same bytes, same hash)."""
    elsewhere = ckpt.parents[2] / "elsewhere.pt"
    shutil.copyfile(ckpt / "rng" / "rank_0.pt", elsewhere)
    (ckpt / "rng" / "rank_0.pt").unlink()
    (ckpt / "rng" / "rank_0.pt").symlink_to(elsewhere)


def _symlinked_dir(ckpt: Path) -> None:
    """A listed file's directory replaced by a symlink to an identical copy elsewhere."""
    elsewhere = ckpt.parents[2] / "rng-elsewhere"
    shutil.copytree(ckpt / "rng", elsewhere)
    shutil.rmtree(ckpt / "rng")
    (ckpt / "rng").symlink_to(elsewhere, target_is_directory=True)


@pytest.mark.parametrize(
    "escape",
    [_escape_via_manifest, _symlinked_file, _symlinked_dir],
    ids=["dotdot-entry", "symlinked-file", "symlinked-dir"],
)
def test_paths_that_escape_the_checkpoint_are_rejected_on_load(
    reference: tuple[Path, dict], escape: Callable[[Path], None]
) -> None:
    root, _ = reference
    run_dir = _damaged_copy(root, f"escape-{escape.__name__}", escape)
    verdict = verify(run_dir / "checkpoints" / "step_00000006")
    report = " ".join(verdict.problems)
    assert not verdict.ok and "points outside the checkpoint" in report
    assert "bytes" not in report and "sha256" not in report  # nothing about the file outside leaks


def test_a_stale_pointer_never_leaves_a_run_stuck(
    reference: tuple[Path, dict], capfd: pytest.CaptureFixture[str]
) -> None:
    """A crash or a full disk between a commit and the pointer's update leaves `latest` naming step 3
    while step 6 is committed. Resuming from 3 would die saving step 6 again, on every restart; resume
    goes by the step each checkpoint holds instead."""
    root, _ = reference
    run_dir = _damaged_copy(root, "stale", lambda c: None)
    (checkpoint_root(run_dir) / LATEST).write_text("step_00000003\n")
    overrides = [*RUN, "--run.id=stale", "--checkpoint.resume=true", "--train.max_steps=9"]
    run_distributed(train_rank, 1, args=(str(root), overrides))
    log = capfd.readouterr().err
    assert "names an older checkpoint" in log and re.search(r"resumed from \S*step_00000006", log)
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003", "step_00000006", "step_00000009"]
    assert (checkpoint_root(run_dir) / LATEST).read_text() == "step_00000009\n"


def test_a_failed_pointer_update_costs_a_warning_not_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The disk fills right after step 3's commit rename (rank 0's pointer write): both ranks carry on,
    and the committed checkpoint is used on resume."""
    monkeypatch.setenv("TRAINMESH_FAULT", "rank=0,step=3,kind=diskfull,phase=commit")
    overrides = [*RUN, "--run.id=full", "--train.micro_batch=4"]
    run_distributed(train_rank, 2, args=(str(tmp_path), overrides))
    log = capfd.readouterr().err
    assert "step_00000003 is committed, but updating checkpoints/latest" in log and "No space left" in log
    run_dir = tmp_path / "runs" / "full"
    assert [p.name for p in list_checkpoints(run_dir)] == ["step_00000003", "step_00000006"]
    assert all(verify(p).ok for p in list_checkpoints(run_dir))


def test_a_symlinked_checkpoints_folder_is_refused_on_save(tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    run_dir = tmp_path / "runs" / "linked"
    run_dir.mkdir(parents=True)
    checkpoint_root(run_dir).symlink_to(outside, target_is_directory=True)
    with pytest.raises(DistributedTestError, match="is a symlink; trainmesh creates files under a run folder only"):
        run_distributed(train_rank, 1, args=(str(tmp_path), [*RUN, "--run.id=linked"]))
    assert not any(outside.iterdir())
