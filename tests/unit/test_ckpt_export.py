"""Export's tensor preparation on a live model, whose tied weights share memory (the e2e tests in
tests/e2e/test_ckpt_cli.py read tensors back from DCP, where the tie is already two copies), the mode of the
files it writes, and the outputs it refuses (another's folder with --force, a folder inside a checkpoint)."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from trainmesh.checkpoint import export
from trainmesh.checkpoint.export import (
    EXPORT_MARKER,
    ExportError,
    ExportUsageError,
    export_checkpoint,
    export_folder,
    save_safetensors,
    standalone_tensors,
)
from trainmesh.recipes.gpt import GPT, GPTConfig


def test_tied_weights_are_kept_under_both_names_with_their_own_memory(tmp_path: Path) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(size="nano", block_size=8, vocab_size=64)
    model = GPT(cfg).eval()
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["wte.weight"].data_ptr()
    with pytest.raises(RuntimeError, match="share memory"):  # why export has to do something
        save_file(state, str(tmp_path / "raw.safetensors"))

    tensors = standalone_tensors(state)
    assert tensors["lm_head.weight"].data_ptr() != tensors["wte.weight"].data_ptr()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_file(tmp_path / "model.safetensors")
    assert sorted(loaded) == sorted(state)
    assert all(torch.equal(loaded[k], state[k]) for k in state)

    fresh = GPT(cfg).eval()
    fresh.load_state_dict(loaded, strict=True)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))  # (B, T)
    with torch.no_grad():
        assert torch.equal(fresh(idx), model(idx))


def test_non_contiguous_tensors_are_made_contiguous_and_non_tensors_refused() -> None:
    t = torch.arange(12.0).view(3, 4).t()
    out = standalone_tensors({"w": t})["w"]
    assert out.is_contiguous() and torch.equal(out, t)
    with pytest.raises(ExportError, match=r"'step' is not a tensor \(int\)"):
        standalone_tensors({"step": 3})


@pytest.fixture(params=[0o022, 0o002])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test runs under this umask (the usual one, and a shared group's)."""
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def test_safetensors_files_get_the_mode_of_any_new_file(tmp_path: Path, umask: int) -> None:
    """safetensors' save_file makes its file mode 0600 whatever the umask; an export's is as any file's."""
    save_file({"w": torch.zeros(2)}, str(tmp_path / "raw.safetensors"))
    assert stat.S_IMODE((tmp_path / "raw.safetensors").stat().st_mode) == 0o600  # why export has to do something
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"old")  # replaced as a whole
    save_safetensors(out, {"w": torch.ones(2)}, {"format": "pt"})
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~umask
    assert torch.equal(load_file(out)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "raw.safetensors"]  # no temporary


def test_inspect_allocates_nothing_for_metadata_claiming_more_than_is_stored(tmp_path: Path) -> None:
    """A forged .metadata naming a 10^12-element tied copy: the tied-weight check reads nothing (it would allocate
    terabytes) and names no tie."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from trainmesh.checkpoint.inspect import tied_copies

    size = torch.Size([10**6, 10**6])
    meta = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [ChunkStorageMetadata([0, 0], size)])
    (tmp_path / "__0_0.distcp").write_bytes(b"\0" * 64)
    assert tied_copies(tmp_path, {"wte.weight": meta, "lm_head.weight": meta}, {"wte.weight"}) == {}


class _Weights:
    """A FolderFormat that writes one file, for export_folder's handling of the folder (the GPT's is e2e)."""

    name = "test"

    def check(self, state: Any) -> None:
        pass

    def write(self, model_state: dict[str, torch.Tensor], state: Any, folder: Path) -> int:
        (folder / "weights.bin").write_bytes(b"new")
        return 1


@pytest.fixture
def stub_checkpoint(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A run folder with a checkpoint that export takes as verified, of step 4 and no tensors."""
    ckpt = tmp_path / "runs" / "r" / "checkpoints" / "step_00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text("{}")
    (ckpt / "manifest.json").write_text("{}")
    monkeypatch.setattr(export, "exportable_checkpoint", lambda path: ckpt)
    monkeypatch.setattr(export.TrainerState, "read", lambda folder: SimpleNamespace(step=4, config={}))
    monkeypatch.setattr(export, "read_full_state", lambda folder: {"model": {}})
    return ckpt


def test_force_replaces_only_an_empty_folder_or_an_earlier_exports(stub_checkpoint: Path, tmp_path: Path) -> None:
    """--force replaced any folder, deleting a user's files; now the rule data prepare's --force follows: an
    empty folder, or one holding trainmesh_export.json and only the files it lists."""
    out = tmp_path / "hf"
    out.mkdir()
    (out / "precious").write_text("keep me")
    message = (
        rf"{out} is not the output of an earlier trainmesh ckpt export \(it has no {EXPORT_MARKER} of trainmesh's; "
        r"exports made before this version have none: remove such a folder yourself\)"
    )
    for force in (False, True):
        with pytest.raises(
            ExportUsageError, match=rf"{message} and holds precious, so it is not replaced, with --force"
        ):
            export_folder(stub_checkpoint, _Weights(), out, force=force)
    (out / "precious").unlink()
    export_folder(stub_checkpoint, _Weights(), out, force=True)  # empty
    assert json.loads((out / EXPORT_MARKER).read_text())["files"] == ["weights.bin"]
    export_folder(stub_checkpoint, _Weights(), out, force=True)  # an earlier export's
    assert sorted(p.name for p in out.iterdir()) == [EXPORT_MARKER, "weights.bin"]
    (out / "notes.txt").write_text("mine")
    with pytest.raises(
        ExportUsageError, match=r"hf holds files an earlier trainmesh ckpt export did not write \(notes"
    ):
        export_folder(stub_checkpoint, _Weights(), out, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "runs"]  # no temporary or old folder left


def test_an_output_inside_a_checkpoint_or_a_runs_checkpoints_folder_is_refused(
    stub_checkpoint: Path, tmp_path: Path
) -> None:
    """Exporting into runs/X/checkpoints/step_4/hf made that checkpoint fail verification afterwards."""
    run = tmp_path / "runs" / "r"
    for out, where in [
        (stub_checkpoint / "hf", "the checkpoint"),
        (stub_checkpoint / "sub" / "model.safetensors", "the checkpoint"),
        (run / "checkpoints" / "hf", "the run's checkpoints folder"),
    ]:
        message = rf"-o {out} is inside {where} .*Fix: -o outside checkpoints/, e.g. -o {run}/export/{out.name}"
        with pytest.raises(ExportUsageError, match=message):
            export_folder(stub_checkpoint, _Weights(), out, force=True)
        with pytest.raises(ExportUsageError, match=message):
            export_checkpoint(stub_checkpoint, out, force=True)
    assert sorted(p.name for p in stub_checkpoint.iterdir()) == ["manifest.json", "trainer_state.json"]
    export_folder(stub_checkpoint, _Weights(), tmp_path / "checkpoints" / "hf")  # a user's own folder of that name
    assert (tmp_path / "checkpoints" / "hf" / "weights.bin").read_bytes() == b"new"


def test_a_stray_metadata_file_above_the_output_is_no_checkpoint(stub_checkpoint: Path, tmp_path: Path) -> None:
    """Any folder holding a `.metadata` file was taken for a checkpoint: -o under a home folder with a stray one was
    refused. A checkpoint's marks are its trainer_state.json, or DCP's .metadata beside its manifest.json."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".metadata").write_text("another program's")
    export_folder(stub_checkpoint, _Weights(), home / "exports" / "hf")
    assert (home / "exports" / "hf" / "weights.bin").read_bytes() == b"new"
    trainer = tmp_path / "hf_out"  # Hugging Face Trainer's output_dir: a trainer_state.json of its own
    (trainer / "checkpoint-500").mkdir(parents=True)
    (trainer / "checkpoint-500" / "trainer_state.json").write_text("{}")
    export_folder(stub_checkpoint, _Weights(), trainer / "checkpoint-500" / "converted")
    (home / "manifest.json").write_text("{}")
    with pytest.raises(ExportUsageError, match=rf"-o {home}/exports/hf2 is inside the checkpoint {home}: "):
        export_folder(stub_checkpoint, _Weights(), home / "exports" / "hf2")


def test_a_folder_left_moved_aside_by_a_killed_force_is_named(
    stub_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A --force killed between its two renames leaves the old folder moved aside, and nothing said so."""
    left = tmp_path / ".hf.old-12345"
    left.mkdir()
    (left / "weights.bin").write_bytes(b"old")
    with caplog.at_level(logging.WARNING, logger="trainmesh"):
        export_folder(stub_checkpoint, _Weights(), tmp_path / "hf")
    assert f"{left} is a folder moved aside while {tmp_path / 'hf'} was replaced, and left there" in caplog.text
    assert (left / "weights.bin").read_bytes() == b"old"  # kept: it may be the only copy of the old export
