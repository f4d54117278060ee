"""`trainmesh ckpt verify|inspect|export` on real checkpoints: verification gates reading, damage is
reported, and an export holds exactly the trained weights."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path
from typing import NamedTuple

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from support import train_rank
from trainmesh.checkpoint.dcp import read_full_state
from trainmesh.cli import main
from trainmesh.recipes.gpt import GPT, GPTConfig
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow


class Trained(NamedTuple):
    run_dir: Path
    """The run; tests below damage its checkpoints."""
    pristine: Path
    """An untouched copy of the run, for tests that need every checkpoint intact (see `fresh_run`)."""
    params: dict[str, torch.Tensor]
    """The trained model's state_dict in memory at the end (step 2), independent of any checkpoint."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    root = tmp_path_factory.mktemp("ckpt")
    overrides = ["--train.max_steps=2", "--checkpoint.every=1", "--checkpoint.final=true", "--run.id=r"]
    [result] = run_distributed(train_rank, 1, args=(str(root), overrides))
    shutil.copytree(root / "runs" / "r", root / "pristine", symlinks=True)
    return Trained(root / "runs" / "r", root / "pristine", result["params"])


@pytest.fixture(scope="module")
def run_dir(trained: Trained) -> Path:
    return trained.run_dir


@pytest.fixture
def fresh_run(trained: Trained, tmp_path: Path) -> Path:
    """A private copy of the run with both checkpoints (steps 1 and 2) intact."""
    return Path(shutil.copytree(trained.pristine, tmp_path / "r", symlinks=True))


def _flip_a_byte(ckpt: Path) -> None:
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def _files_under(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def test_verify_and_inspect_a_healthy_run(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ckpt", "verify", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "OK      " in out and "step_00000001" in out and "step_00000002" in out
    assert main(["ckpt", "inspect", str(run_dir / "checkpoints" / "step_00000002")]) == 0
    out = capsys.readouterr().out
    assert "step 2, 8 samples seen, saved by 1 rank(s)" in out
    assert "wte.weight" in out and "(256, 32)" in out and "torch.float32" in out


def test_inspect_counts_the_parameters_as_the_run_did(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The tied head is stored under both names (as two copies), but it is one parameter: inspect's count is the
    model's, the number the run logged (`N parameters`)."""
    ckpt = run_dir / "checkpoints" / "step_00000002"
    saved = json.loads((ckpt / "trainer_state.json").read_text())["config"]["model"]
    model = GPT(GPTConfig(**saved))
    assert model.lm_head.weight is model.wte.weight
    parameters = sum(p.numel() for p in model.parameters())  # each once, as train/setup.py logs it
    assert main(["ckpt", "inspect", str(ckpt)]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  model: ")]
    assert line == (
        f"  model: {len(model.state_dict())} tensors, {parameters:,} parameters "
        "(tied, stored twice and counted once: lm_head.weight is wte.weight)"
    )


def test_damage_is_reported_and_blocks_inspection(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = run_dir / "checkpoints" / "step_00000001"
    shard = next(ckpt.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[0] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(run_dir)]) == 1
    out = capsys.readouterr().out
    assert f"INVALID {ckpt}" in out and "sha256" in out and "OK      " in out  # step 2 is still fine
    assert main(["ckpt", "inspect", str(ckpt)]) == 1
    assert main(["ckpt", "verify", str(run_dir / "nope")]) == 1


def test_export_is_bit_exact_and_loads_strictly(
    fresh_run: Path, trained: Trained, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ckpt", "export", str(fresh_run)]) == 0  # a run directory: its newest checkpoint
    out = fresh_run / "export" / "model_step_00000002.safetensors"
    printed = capsys.readouterr().out
    assert str(out) in printed and f"{len(trained.params)} tensors" in printed
    assert f"{out.stat().st_size:,} bytes" in printed

    exported = load_file(out)
    from_ckpt = read_full_state(fresh_run / "checkpoints" / "step_00000002")["model"]
    assert sorted(exported) == sorted(from_ckpt) == sorted(trained.params)
    assert {"wte.weight", "lm_head.weight"} <= exported.keys()  # the tied pair, under both names
    for name, tensor in exported.items():
        assert tensor.dtype == from_ckpt[name].dtype == trained.params[name].dtype, name
        assert torch.equal(tensor, from_ckpt[name]), name
        assert torch.equal(tensor, trained.params[name]), name

    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and meta["trainmesh.step"] == "2" and meta["trainmesh.recipe"] == "gpt"
    assert json.loads(meta["trainmesh.exported_with"])["torch"] == torch.__version__
    assert json.loads(meta["trainmesh.saved_with"])["trainmesh"]
    cfg = GPTConfig(**json.loads(meta["trainmesh.model_config"]))
    assert (cfg.size, cfg.n_layer, cfg.n_embd, cfg.vocab_size) == ("nano", 2, 32, 256)

    torch.manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))  # (B, T)
    reference, loaded, untrained = GPT(cfg).eval(), GPT(cfg).eval(), GPT(cfg).eval()
    reference.load_state_dict(trained.params, strict=True)
    loaded.load_state_dict(exported, strict=True)
    assert loaded.lm_head.weight is loaded.wte.weight  # loading kept the tie
    with torch.no_grad():
        assert torch.equal(loaded(idx), reference(idx))
        assert not torch.equal(untrained(idx), reference(idx))  # the comparison can tell models apart


def test_export_of_a_checkpoint_directory_to_a_chosen_file(fresh_run: Path, tmp_path: Path) -> None:
    step1 = fresh_run / "checkpoints" / "step_00000001"
    out = tmp_path / "elsewhere" / "step1.safetensors"
    assert main(["ckpt", "export", str(step1), "-o", str(out)]) == 0
    exported = load_file(out)
    from_step1 = read_full_state(step1)["model"]
    from_step2 = read_full_state(fresh_run / "checkpoints" / "step_00000002")["model"]
    assert all(torch.equal(exported[name], from_step1[name]) for name in from_step1)
    assert not all(torch.equal(exported[name], from_step2[name]) for name in from_step2)  # not the newest
    assert not (fresh_run / "export").exists()
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata()["trainmesh.step"] == "1"


def test_export_refuses_to_overwrite_without_force(
    fresh_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "model.safetensors"
    out.write_bytes(b"precious")
    assert main(["ckpt", "export", str(fresh_run), "-o", str(out)]) == 2  # to fix in the command: 2
    err = capsys.readouterr().err
    assert f"{out} already exists" in err and "--force" in err
    assert out.read_bytes() == b"precious"
    assert main(["ckpt", "export", str(fresh_run), "-o", str(out), "--force"]) == 0
    exported = load_file(out)
    from_ckpt = read_full_state(fresh_run / "checkpoints" / "step_00000002")["model"]
    assert sorted(exported) == sorted(from_ckpt) and all(torch.equal(exported[k], from_ckpt[k]) for k in from_ckpt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "r"]  # no temporary file left
    assert main(["ckpt", "inspect", str(fresh_run), "-o", str(out)]) == 2  # export-only flags


def test_export_refuses_a_damaged_checkpoint(fresh_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    step1, step2 = (fresh_run / "checkpoints" / f"step_0000000{n}" for n in (1, 2))
    _flip_a_byte(step2)
    before = _files_under(fresh_run)
    assert main(["ckpt", "export", str(step2)]) == 1
    err = capsys.readouterr().err
    assert "refusing to export an unverified checkpoint" in err and "sha256" in err and "distcp" in err
    assert _files_under(fresh_run) == before and not (fresh_run / "export").exists()  # nothing written

    assert main(["ckpt", "export", str(fresh_run)]) == 0  # a run directory: the newest one that verifies
    assert f"skipping {step2}" in capsys.readouterr().err
    assert sorted(p.name for p in (fresh_run / "export").iterdir()) == ["model_step_00000001.safetensors"]
    exported = load_file(fresh_run / "export" / "model_step_00000001.safetensors")
    from_step1 = read_full_state(step1)["model"]
    assert sorted(exported) == sorted(from_step1) and all(torch.equal(exported[k], from_step1[k]) for k in from_step1)

    shutil.rmtree(fresh_run / "export")
    _flip_a_byte(step1)
    assert main(["ckpt", "export", str(fresh_run)]) == 1
    assert "no checkpoint of this run verifies" in capsys.readouterr().err
    assert not (fresh_run / "export").exists()


def test_exported_files_get_the_mode_of_any_new_file(fresh_run: Path, tmp_path: Path) -> None:
    """Under a known umask every file an export writes, in both formats, has the mode a plain open() gives a new
    file there (safetensors' own writer makes 0600 files)."""
    before = os.umask(0o002)
    try:
        (tmp_path / "reference").write_text("")
        assert main(["ckpt", "export", str(fresh_run)]) == 0
        assert main(["ckpt", "export", "--format", "hf", str(fresh_run)]) == 0
    finally:
        os.umask(before)
    expected = stat.S_IMODE((tmp_path / "reference").stat().st_mode)
    assert expected == 0o664
    written = _files_under(fresh_run / "export")
    names = ["config.json", "model.safetensors", "trainmesh_export.json", "model_step_00000002.safetensors"]
    assert [p.name for p in written] == names
    assert {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == dict.fromkeys(
        (p.name for p in written), oct(expected)
    )
