"""The command line's parser: instant (no torch import), --version, the recipe names it lists, launch flags from
torchrun's PET_ variables, --auto-resume's errors, and `env --full`."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainmesh.cli import RECIPE_NAMES, main
from trainmesh.recipes import RECIPES


def test_help_and_version_import_no_torch() -> None:
    """`trainmesh --help` in well under a second: the parser must not pull in torch (1.5 s here)."""
    probe = "import sys, trainmesh.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_a_launcher_and_a_worker_start_without_dcp_or_dtensor() -> None:
    """DCP imports DTensor, which imports sympy and DTensor's sharding rules: a second of every process's start. They
    are imported where a checkpoint is read or written and where DTensors are made (fsdp, pipeline, tensor
    parallelism); `trainmesh run`'s launcher and a worker's modules import neither."""
    modules = "trainmesh.cli.run, trainmesh.job.worker, trainmesh.train.loop, trainmesh.checkpoint, trainmesh.runtime"
    heavy = "('torch.distributed.tensor', 'torch.distributed.checkpoint', 'torch.distributed.fsdp')"
    probe = f"import sys, {modules}; sys.exit(', '.join(m for m in {heavy} if m in sys.modules) or None)"
    done = subprocess.run([sys.executable, "-c", probe], check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"imported: {done.stderr}"


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("trainmesh ")


def test_the_parser_lists_every_built_in_recipe() -> None:
    assert set(RECIPE_NAMES) == set(RECIPES)


GPT2 = str(Path(__file__).resolve().parents[2] / "configs" / "gpt2-124m.toml")


def test_launch_flags_left_out_come_from_torchruns_pet_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """As torchrun's flags do: what Kubeflow's operators set for a pod (PET_NNODES, PET_NPROC_PER_NODE, ...)."""
    for key, value in {"NNODES": "2", "NPROC_PER_NODE": "4", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(f"PET_{key}", value)
    monkeypatch.setenv("PET_MASTER_PORT", "29500")
    assert main(["check", "gpt", "--config", GPT2]) == 0
    assert "world size 8: OK" in capsys.readouterr().out
    assert main(["check", "gpt", "--config", GPT2, "--nproc-per-node", "1"]) == 0  # a flag given wins
    assert "world size 2: OK" in capsys.readouterr().out
    monkeypatch.setenv("PET_NNODES", "1:2")  # an elastic PyTorchJob
    monkeypatch.setenv("PET_RDZV_ENDPOINT", "127.0.0.1:29400")
    assert main(["check", "gpt", "--config", GPT2]) == 0
    out = capsys.readouterr().out
    assert "world size 4: OK" in out and "world size 8: OK" in out


def test_a_bad_pet_variable_is_named_and_a_flag_given_wins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """argparse would say "argument --max-restarts: invalid int value", naming a flag the user did not type;
    and it converts the variable before it reads a flag given after the recipe's name, which then wins."""
    monkeypatch.setenv("PET_MAX_RESTARTS", "three")
    fix = "PET_MAX_RESTARTS='three', from the environment (a launch flag left out is read from PET_<FLAG>"
    script = tmp_path / "train.py"
    script.write_text("")
    for argv in (
        ["check", "gpt", "--config", GPT2, "--nproc-per-node", "1"],
        ["run", "--nproc-per-node", "1", str(script)],
    ):
        with pytest.raises(SystemExit) as refused:
            main(argv)
        assert refused.value.code == 2 and fix in capsys.readouterr().err
    assert main(["check", "gpt", "--config", GPT2, "--nproc-per-node", "1", "--max-restarts", "1"]) == 0
    assert main(["check", "--max-restarts", "1", "gpt", "--config", GPT2, "--nproc-per-node", "1"]) == 0
    monkeypatch.delenv("PET_MAX_RESTARTS")
    with pytest.raises(SystemExit):
        main(["check", "gpt", "--max-restarts", "three"])  # typed: argparse's own message, naming the flag
    assert "argument --max-restarts/--max_restarts: invalid int value: 'three'" in capsys.readouterr().err


def test_a_rendezvous_backend_trainmesh_does_not_use_is_refused(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PET_RDZV_BACKEND", "etcd")
    assert main(["check", "gpt", "--config", GPT2, "--nproc-per-node", "1"]) == 2
    assert "PET_RDZV_BACKEND='etcd'" in capsys.readouterr().err


def test_kubeflow_master_address_hint(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A PyTorchJob with a Master sets MASTER_ADDR, not PET_MASTER_ADDR: the error says what to add."""
    monkeypatch.setenv("PET_NNODES", "2")
    monkeypatch.setenv("MASTER_ADDR", "job-master-0")
    assert main(["check", "gpt", "--config", GPT2, "--nproc-per-node", "1"]) == 2
    assert "add --master-addr $(MASTER_ADDR) --master-port $(MASTER_PORT)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--auto-resume"], "--auto-resume needs the run's name"),
        (["--auto-resume", "--resume", "--run-id", "x"], "--resume and --auto-resume both given"),
    ],
)
def test_auto_resume_needs_a_name_and_no_resume(
    flags: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["run", "gpt", "--config", GPT2, "--nproc-per-node", "1", *flags]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "runs").exists()


def test_env_full_adds_pytorchs_report(capsys: pytest.CaptureFixture[str]) -> None:
    """collect_env runs its probes (nvidia-smi, pip, ...) as subprocesses: quick without a GPU or a network."""
    started = time.monotonic()
    assert main(["env", "--full"]) == 0
    out = capsys.readouterr().out
    assert out.index("trainmesh environment") < out.index("PyTorch's report (torch.utils.collect_env)")
    assert "PyTorch version:" in out and "\nOS:" in out and "Is CUDA available:" in out
    assert time.monotonic() - started < 60
