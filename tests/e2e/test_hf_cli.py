"""Hugging Face interop through the real command line: a trained GPT exported with `trainmesh ckpt export --format hf`
loads in transformers and computes trainmesh's logits; the exported folder starts a new run (`model.init_from`)
with exactly the checkpoint's weights; and what cannot be done is refused with exit code 2 and a fix."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from support import nano_config, refused_before_writing, train_rank
from trainmesh.checkpoint.dcp import read_full_state
from trainmesh.cli import main
from trainmesh.config import load_toml
from trainmesh.config.schema import DistConfig
from trainmesh.job.spec import load_config
from trainmesh.job.worker import run_worker
from trainmesh.recipes.gpt import GPT, GPTConfig, GPTRecipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

STEP2 = "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A pristine nano GPT run with checkpoints at steps 1 and 2 (copy it before changing anything)."""
    root = tmp_path_factory.mktemp("hf")
    overrides = ["--train.max_steps=2", "--checkpoint.every=1", "--checkpoint.final=true", "--run.id=r"]
    run_distributed(train_rank, 1, args=(str(root), overrides))
    return root / "runs" / "r"


@pytest.fixture
def run_dir(trained: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(trained, tmp_path / "r", symlinks=True))


def _checkpoint_model(ckpt: Path) -> GPT:
    """trainmesh's GPT with a checkpoint's weights, as `ckpt export` (safetensors) users load it."""
    state = json.loads((ckpt / "trainer_state.json").read_text())
    model = GPT(GPTConfig(**state["config"]["model"])).eval()
    model.load_state_dict(read_full_state(ckpt)["model"], strict=True)
    return model


def test_an_exported_gpt_loads_in_transformers_and_computes_the_same_logits(
    run_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ckpt", "export", "--format", "hf", str(run_dir)]) == 0  # the run's newest checkpoint
    out = run_dir / "export" / "hf_step_00000002"
    printed = capsys.readouterr().out
    assert f"-> {out}: 28 tensors" in printed  # 2 + 12 per block + 2: the tied head is not stored
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "trainmesh_export.json"]
    assert sorted(p.name for p in (run_dir / "export").iterdir()) == ["hf_step_00000002"]  # no temporary left
    config = json.loads((out / "config.json").read_text())
    assert config["n_positions"] == 32 and config["vocab_size"] == 256 and config["eos_token_id"] is None
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["trainmesh.step"] == "2"
        assert f.get_slice("transformer.h.0.attn.c_attn.weight").get_shape() == [32, 96]  # Conv1D: (in, out)

    hf = transformers.GPT2LMHeadModel.from_pretrained(out).eval()
    assert hf.lm_head.weight.data_ptr() == hf.transformer.wte.weight.data_ptr()  # tied by transformers
    ours = _checkpoint_model(run_dir / STEP2)
    torch.manual_seed(0)
    idx = torch.randint(0, 256, (2, 32))  # (B, T)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, ours(idx), atol=1e-5, rtol=1e-5)
        untrained = GPT(ours.cfg, seed=ours.init_seed + 1).eval()
        assert not torch.allclose(hf(idx).logits, untrained(idx), atol=1e-3)  # the comparison can tell models apart


def test_an_exported_folder_starts_a_run_with_exactly_the_checkpoints_weights(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "exported"
    assert main(["ckpt", "export", str(run_dir / STEP2), "--format=hf", "-o", str(out)]) == 0
    reference = _checkpoint_model(run_dir / STEP2).state_dict()
    init = f"--model.init_from={out}"
    [result] = run_distributed(train_rank, 1, args=(str(tmp_path), [init, "--train.max_steps=1", "--run.id=ft"]))
    written = load_toml(tmp_path / "runs" / "ft" / "config.toml")["model"]
    assert written["init_from"] == str(out) and (written["n_layer"], written["n_head"], written["n_embd"]) == (2, 2, 32)

    # the same config, built here: its initial weights are the checkpoint's, bit for bit
    model = GPTRecipe().build_model(
        nano_config(tmp_path, init), Runtime(strategy="single", dist_config=DistConfig(device="cpu"))
    )
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, reference[name]), name
    assert result["train_loss"] > 0  # and it trained a step from there


def test_exporting_over_an_existing_folder_needs_force(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = run_dir.parent / "hf"
    out.mkdir()
    assert main(["ckpt", "export", "--format", "hf", str(run_dir), "-o", str(out)]) == 2
    assert f"{out} already exists" in capsys.readouterr().err
    (out / "precious").write_text("keep me")  # --force replaces only an empty folder or an earlier export's
    assert main(["ckpt", "export", "--format", "hf", str(run_dir), "-o", str(out), "--force"]) == 2
    assert "is not the output of an earlier trainmesh ckpt export" in capsys.readouterr().err
    (out / "precious").unlink()
    for _ in range(2):  # the empty folder, then the earlier export
        assert main(["ckpt", "export", "--format", "hf", str(run_dir), "-o", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "trainmesh_export.json"]
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["hf", "r"]  # no temporary or old folder left
    file = run_dir.parent / "model.safetensors"
    file.write_text("a file")
    assert main(["ckpt", "export", "--format", "hf", str(run_dir), "-o", str(file), "--force"]) == 2
    assert "is a file; --format hf writes a folder" in capsys.readouterr().err
    assert main(["ckpt", "inspect", str(run_dir), "--format", "hf"]) == 2  # an export-only flag


def test_an_export_never_takes_a_folder_that_appeared_while_it_was_written(run_dir: Path) -> None:
    """Without --force the output must not exist at the start, and must still not exist at the commit: a
    folder another process made there meanwhile is left alone (it was moved aside and deleted)."""
    from trainmesh.checkpoint.export import ExportUsageError, export_folder
    from trainmesh.recipes.gpt.hf_export import HFFormat

    out = run_dir.parent / "hf"

    class Raced(HFFormat):
        def write(self, model_state: dict[str, torch.Tensor], state: Any, folder: Path) -> int:
            out.mkdir()
            (out / "precious").write_text("another process's")
            return super().write(model_state, state, folder)

    with pytest.raises(ExportUsageError, match=r"hf appeared while the export was written .* not replaced without"):
        export_folder(run_dir, Raced(), out)
    assert [p.name for p in out.iterdir()] == ["precious"]
    assert sorted(p.name for p in run_dir.parent.iterdir()) == ["hf", "r"]  # no temporary folder left


def resnet_rank(rank: int, root: str) -> None:
    overrides = ["--model.width=4", "--model.image_size=16", "--train.max_steps=1", "--train.eval_every=0"]
    overrides += ["--run.progress=false", "--checkpoint.final=true", "--run.id=res", f"--run.out_dir={root}/runs"]
    config = load_config(None, overrides, "resnet")
    run_worker(config, Path(root) / "runs" / "res")


def test_a_resnet_checkpoint_is_refused_naming_the_format(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_distributed(resnet_rank, 1, args=(str(tmp_path),))
    run = tmp_path / "runs" / "res"
    assert main(["ckpt", "export", "--format", "hf", str(run)]) == 2
    err = capsys.readouterr().err
    assert "saved by the resnet recipe" in err and "Fix: --format safetensors" in err and "Traceback" not in err
    assert not (run / "export").exists()
    assert main(["ckpt", "export", str(run)]) == 0  # the default format takes any recipe


@pytest.mark.parametrize("case", ["missing", "bin only", "mismatch", "too long"])
def test_init_from_folders_that_cannot_be_used_stop_the_run_before_launch(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "gpt2"
    settings: dict[str, Any] = {"n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 16, "vocab_size": 256}
    if case != "missing":
        transformers.GPT2LMHeadModel(transformers.GPT2Config(**settings)).save_pretrained(folder)
    if case == "bin only":
        (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    extra = {"mismatch": ["--model.n_embd=64", "--model.block_size=16"], "too long": ["--model.block_size=32"]}
    argv = [
        "run",
        "gpt",
        f"--model.init_from={folder}",
        "--nproc-per-node=1",
        *extra.get(case, ["--model.block_size=16"]),
    ]
    err = refused_before_writing(tmp_path, capsys, *argv)
    expected = {
        "missing": "is not a folder on this machine. trainmesh reads local folders only and downloads nothing",
        "bin only": "has no model.safetensors (pytorch_model.bin). trainmesh reads safetensors only",
        "mismatch": "model.n_embd=64, but",
        "too long": "model.block_size=32 is longer than the 16 positions of model.init_from",
    }[case]
    assert expected in err and "Fix:" in err
