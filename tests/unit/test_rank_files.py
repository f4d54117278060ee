"""Each rank's `rng/rank_<r>.pt` is judged with the rest of a checkpoint, before a resume picks it: a forged or
malformed one makes the checkpoint invalid (set aside, the previous one tried), like forged DCP metadata, and
checking it neither runs its payload nor touches this process's random streams; a failure that says nothing about
the files (out of memory) is not taken for a bad checkpoint. The resume itself:
tests/distributed/test_hostile_checkpoints.py."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainmesh.checkpoint import rank_files
from trainmesh.checkpoint.catalog import check_checkpoint
from trainmesh.checkpoint.dcp import rng_state, single_process_quiet
from trainmesh.checkpoint.manifest import file_matches, write_manifest_here
from trainmesh.checkpoint.rank_files import UntrustedCheckpointError, read_rank_file


class Payload:
    """Unpickled by a plain unpickler, this creates a file: what an attacker's payload would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def checkpoint(folder: Path, world_size: int = 2) -> Path:
    """A committed checkpoint as the saver writes one, without training: DCP files, trainer state, RNG files,
    manifest."""
    ckpt = folder / "step_00000003"
    with single_process_quiet():
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(ckpt), no_dist=True)
    state = {"step": 3, "samples_seen": 24, "world_size": world_size}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    (ckpt / "rng").mkdir()
    for rank in range(world_size):
        torch.save({**rng_state(), "strategy": {}}, ckpt / "rng" / f"rank_{rank}.pt")
    write_manifest_here(ckpt)
    return ckpt


def forge(ckpt: Path, rank: int, value: Any) -> None:
    """Replace a rank's RNG file, and rewrite the manifest to match, as anyone can."""
    torch.save(value, ckpt / "rng" / f"rank_{rank}.pt")
    (ckpt / "manifest.json").unlink()
    write_manifest_here(ckpt)


def test_a_checkpoint_with_genuine_rng_files_is_valid_and_checking_it_leaves_the_streams_alone(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path)
    torch.manual_seed(1)  # other states than the saved ones
    np.random.seed(1)
    random.seed(1)
    before = rng_state()
    assert check_checkpoint(ckpt) == []
    after = rng_state()
    assert torch.equal(before["torch"], after["torch"]) and torch.equal(before["numpy"][1], after["numpy"][1])
    assert torch.equal(before["python"][1], after["python"][1])


@pytest.mark.parametrize(
    ("forged", "evidence"),
    [
        ("payload", r"rank_1.pt: refused, Weights only load failed"),
        ("not a dict", r"rank_1.pt: not the RNG state trainmesh writes \(TypeError: a list"),
        ("torch state", r"rank_1.pt: not the RNG state trainmesh writes \(RuntimeError"),
        ("python state", r"rank_1.pt: not the RNG state trainmesh writes \(ValueError"),
        ("strategy", r"rank_1.pt: not the RNG state trainmesh writes \(TypeError: strategy is a str"),
    ],
)
def test_a_forged_or_malformed_rng_file_invalidates_the_checkpoint(tmp_path: Path, forged: str, evidence: str) -> None:
    ckpt = checkpoint(tmp_path)
    marker = tmp_path / "payload-ran"
    genuine = {**rng_state(), "strategy": {}}
    python = genuine["python"]
    value = {
        "payload": {**genuine, "torch": Payload(marker)},
        "not a dict": [1, 2],
        "torch state": {**genuine, "torch": torch.zeros(3, dtype=torch.uint8)},
        "python state": {**genuine, "python": [python[0], python[1][:10], python[2]]},
        "strategy": {**genuine, "strategy": "powersgd"},
    }[forged]
    forge(ckpt, 1, value)
    (problem,) = check_checkpoint(ckpt)
    assert re.search(evidence, problem), problem
    assert not marker.exists()


def test_checking_maps_the_rng_files_and_refuses_a_symlink(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verify has just read each file whole to hash it, and the resume reads it again: the check maps it, so its
    strategy state (as large as the gradients with PowerSGD) is not read a third time."""
    ckpt = checkpoint(tmp_path)
    loads: list[dict[str, Any]] = []
    real = torch.load
    monkeypatch.setattr(rank_files.torch, "load", lambda f, **kw: loads.append(kw) or real(f, **kw))
    assert check_checkpoint(ckpt) == []
    assert [kw.get("mmap") for kw in loads] == [True, True], loads
    # a file torch cannot map (its older format here; a file system without mmap) is judged as the resume reads it
    torch.save({**rng_state(), "strategy": {}}, ckpt / "rng" / "rank_1.pt", _use_new_zipfile_serialization=False)
    (ckpt / "manifest.json").unlink()
    write_manifest_here(ckpt)
    assert check_checkpoint(ckpt) == []
    (tmp_path / "rank_0.pt").symlink_to(ckpt / "rng" / "rank_0.pt")
    with pytest.raises(UntrustedCheckpointError, match=r"rank_0.pt: not the RNG state .*UnsafePathError: .* symlink"):
        read_rank_file(tmp_path / "rank_0.pt", mapped=True)


def test_running_out_of_memory_while_checking_is_not_a_bad_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A MemoryError says nothing about the file: it stops the resume rather than set a good checkpoint aside."""
    ckpt = checkpoint(tmp_path)

    def out_of_memory(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError

    monkeypatch.setattr(rank_files.torch, "load", out_of_memory)
    with pytest.raises(MemoryError):
        check_checkpoint(ckpt)


def test_a_manifest_nested_too_deeply_is_garbled_not_a_crash(tmp_path: Path) -> None:
    """5000 '[': json recurses once per bracket, and a RecursionError would stop every rank's resume."""
    ckpt = checkpoint(tmp_path)
    (ckpt / "manifest.json").write_text("[" * 5000)
    (problem,) = check_checkpoint(ckpt)
    assert problem == f"{ckpt / 'manifest.json'}: garbled (nested too deeply to be a manifest)"
    assert not file_matches(ckpt, "trainer_state.json")
