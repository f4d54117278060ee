"""A checkpoint folder from elsewhere can run nothing and mislead nothing: forged pickles (DCP's metadata, a
rank's RNG file, a value inside a shard) are refused with their manifests recomputed to match, and a trainer
state with impossible values or another run's step is set aside instead of being resumed."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from support import train_rank
from trainmesh.checkpoint import list_checkpoints, read_full_state, verify
from trainmesh.checkpoint.dcp import single_process_quiet
from trainmesh.checkpoint.manifest import file_digest
from trainmesh.checkpoint.reader import UntrustedCheckpointError, read_metadata
from trainmesh.checkpoint.state import InvalidTrainerState, TrainerState
from trainmesh.cli import main
from trainmesh.testing import DistributedTestError, run_distributed

pytestmark = pytest.mark.slow

RUN = ["--train.micro_batch=8", "--train.max_steps=6", "--checkpoint.every=3", "--checkpoint.final=true"]


class Marker:
    """Unpickled by a plain unpickler, this creates a file: what an attacker's payload would do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile")
    run_distributed(train_rank, 1, args=(str(root), [*RUN, "--run.id=ref"]))
    return root


@pytest.fixture(scope="module")
def reference_params(root: Path) -> dict[str, torch.Tensor]:
    return read_full_state(root / "runs" / "ref" / "checkpoints" / "step_00000006")["model"]


def _copy(root: Path, name: str) -> Path:
    shutil.copytree(root / "runs" / "ref", root / "runs" / name)
    return root / "runs" / name / "checkpoints" / "step_00000006"


def _rehash(ckpt: Path) -> None:
    """What an attacker does after changing files: a manifest that matches them again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest["files"] = {name: file_digest(ckpt / name) for name in files}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def _forge_metadata(ckpt: Path, marker: Path) -> None:
    metadata = read_metadata(ckpt)
    metadata.storage_meta.modules = [Marker(marker)]  # type: ignore[union-attr, list-item]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(ckpt)


def _forge_shard_value(ckpt: Path, marker: Path) -> None:
    """Rewrite the checkpoint with DCP itself, one optimizer hyperparameter replaced by the payload."""
    state = read_full_state(ckpt)
    state["optim"]["param_groups"][0]["lr"] = Marker(marker)
    for old in [*ckpt.glob("*.distcp"), ckpt / ".metadata"]:
        old.unlink()
    with single_process_quiet():
        dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    _rehash(ckpt)


def _resume(root: Path, name: str) -> dict[str, Any]:
    (result,) = run_distributed(train_rank, 1, args=(str(root), [*RUN, f"--run.id={name}", "--checkpoint.resume=true"]))
    return result


def test_forged_metadata_runs_nothing_anywhere_and_resume_falls_back(
    root: Path, reference_params: dict[str, torch.Tensor], capfd: pytest.CaptureFixture[str]
) -> None:
    marker = root / "metadata-payload-ran"
    ckpt = _copy(root, "forged-metadata")
    _forge_metadata(ckpt, marker)
    assert pickle.loads((ckpt / ".metadata").read_bytes()) is not None and marker.exists()  # the payload is live
    marker.unlink()

    assert main(["ckpt", "verify", str(ckpt)]) == 1
    out = capfd.readouterr().out
    assert f"INVALID {ckpt}" in out and re.search(r"\.metadata tries to load \w+\.open", out), out
    assert main(["ckpt", "inspect", str(ckpt)]) == 1
    assert main(["ckpt", "export", str(ckpt), "-o", str(root / "forged.safetensors")]) == 1
    assert "untrusted checkpoint" in capfd.readouterr().err
    with pytest.raises(UntrustedCheckpointError, match="tries to load"):
        read_full_state(ckpt)

    result = _resume(root, "forged-metadata")  # set aside like a damaged checkpoint; the older one is used
    log = capfd.readouterr().err
    assert "tries to load" in log and re.search(r"resumed from \S*step_00000003", log)
    assert (ckpt.parent / "step_00000006.corrupt").is_dir()
    assert all(torch.equal(result["params"][k], v) for k, v in reference_params.items())
    assert not marker.exists() and not (root / "forged.safetensors").exists()


def test_a_forged_rng_file_runs_nothing_and_resume_falls_back(
    root: Path, reference_params: dict[str, torch.Tensor], capfd: pytest.CaptureFixture[str]
) -> None:
    """As forged metadata: judged when the checkpoint is chosen, not halfway through loading it (the model and
    optimizer were loaded by then, and the run died)."""
    marker = root / "rng-payload-ran"
    ckpt = _copy(root, "forged-rng")
    torch.save({"torch": Marker(marker)}, ckpt / "rng" / "rank_0.pt")
    _rehash(ckpt)

    assert main(["ckpt", "verify", str(ckpt)]) == 1
    assert "rank_0.pt: refused, Weights only load failed" in capfd.readouterr().out
    result = _resume(root, "forged-rng")
    log = capfd.readouterr().err
    assert "rank_0.pt: refused" in log and re.search(r"resumed from \S*step_00000003", log)
    assert (ckpt.parent / "step_00000006.corrupt").is_dir()
    assert all(torch.equal(result["params"][k], v) for k, v in reference_params.items())
    assert not marker.exists()


def test_forged_metadata_cannot_change_a_class_either(tmp_path: Path) -> None:
    """Even with allowed globals only, pickle's BUILD could set attributes on an allowed *class*:
    `PosixPath._str` redirected, every path of the process would name the attacker's file."""
    ckpt = tmp_path / "ckpt"
    with single_process_quiet():
        dcp.save({"model": {"w": torch.ones(3)}}, checkpoint_id=str(ckpt), no_dist=True)
    genuine = pickle.dumps(read_metadata(ckpt), protocol=2)

    def text(value: str) -> bytes:
        return b"X" + len(value.encode()).to_bytes(4, "little") + value.encode()

    victim = str(tmp_path / "victim")  # GLOBAL pathlib.PosixPath, (None, {"_str": victim}), BUILD, POP
    poison = b"\x80\x02cpathlib\nPosixPath\nN}" + text("_str") + text(victim) + b"s\x86b0"
    (ckpt / ".metadata").write_bytes(poison + genuine[2:])
    with pytest.raises(UntrustedCheckpointError, match="tries to set the attributes of <class 'pathlib.PosixPath'>"):
        read_metadata(ckpt)
    assert str(Path("/etc/hostname")) == "/etc/hostname"  # the class is untouched


def test_a_forged_value_inside_a_shard_is_refused(root: Path, capfd: pytest.CaptureFixture[str]) -> None:
    marker = root / "shard-payload-ran"
    ckpt = _copy(root, "forged-shard")
    _forge_shard_value(ckpt, marker)
    assert not marker.exists()

    assert main(["ckpt", "export", str(ckpt), "-o", str(root / "forged.safetensors")]) == 1
    assert "param_groups.0.lr' is a pickle that only code could build" in capfd.readouterr().err
    with pytest.raises(DistributedTestError, match="only code could build"):
        _resume(root, "forged-shard")
    assert not marker.exists()


def _rewrite_state(ckpt: Path, **changes: Any) -> None:
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state.update(changes)
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    _rehash(ckpt)


@pytest.mark.parametrize(
    ("changes", "evidence"),
    [
        ({"step": -3}, "step is -3, expected an integer from 0"),
        ({"step": "6"}, "step is '6'"),
        ({"world_size": 0}, "world_size is 0"),
        ({"precision": {"scaler": {"scale": [1, 2]}}}, "precision holds a value"),
        ({"step": 4}, "holds step 4, not"),
    ],
)
def test_impossible_trainer_states_are_set_aside(
    root: Path, changes: dict[str, Any], evidence: str, capfd: pytest.CaptureFixture[str]
) -> None:
    name = "state-" + re.sub(r"\W", "", json.dumps(changes))
    ckpt = _copy(root, name)
    _rewrite_state(ckpt, **changes)
    _resume(root, name)
    log = capfd.readouterr().err
    assert evidence in log and re.search(r"resumed from \S*step_00000003", log)
    assert any(re.fullmatch(r"step_00000006\.(corrupt|foreign)", p.name) for p in ckpt.parent.iterdir())


def test_files_a_manifest_does_not_list_make_a_checkpoint_invalid(root: Path) -> None:
    """A hostile folder drops the RNG files from the manifest and links `rng` elsewhere: what is on disk must
    be exactly what the manifest lists, and nothing in a checkpoint may be a symlink."""
    ckpt = _copy(root, "unlisted")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("rng/")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    problems = " ".join(verify(ckpt).problems)
    assert "rank_0.pt: not in manifest.json" in problems
    elsewhere = root / "rng-elsewhere"
    shutil.move(ckpt / "rng", elsewhere)
    (ckpt / "rng").symlink_to(elsewhere, target_is_directory=True)
    assert "rng: a symlink inside the checkpoint" in " ".join(verify(ckpt).problems)


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("size-text", {"size": "12", "sha256": "0" * 64}),
        ("size-negative", {"size": -1, "sha256": "0" * 64}),
        ("hash-short", {"size": 1, "sha256": "x"}),
        ("not-an-object", []),
    ],
)
def test_a_manifest_entry_of_the_wrong_type_is_garbled(root: Path, name: str, entry: Any) -> None:
    ckpt = _copy(root, f"entry-{name}")
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["files"]["trainer_state.json"] = entry
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    (problem,) = verify(ckpt).problems
    assert "manifest.json: garbled (entry 'trainer_state.json' is not" in problem


def test_trainer_state_validation_names_the_value() -> None:
    good = {"step": 3, "samples_seen": 24, "world_size": 1, "config": {}, "versions": {"torch": "2"}}
    assert TrainerState.from_dict(good).step == 3
    for bad, message in [
        ({**good, "step": 10**13}, "step is 10000000000000"),
        ({**good, "step": True}, "step is True"),
        ({**good, "samples_seen": -1}, "samples_seen is -1"),
        ({**good, "config": []}, "config is a list"),
        ({**good, "versions": {"torch": 2}}, "versions holds a value"),
        ({**good, "surprise": 1}, "unknown keys ['surprise']"),
        ([1, 2], "a list, expected an object"),
    ]:
        with pytest.raises(InvalidTrainerState, match=re.escape(message)):
            TrainerState.from_dict(bad)


def test_another_runs_checkpoint_copied_in_is_set_aside_before_it_collides(
    root: Path, reference_params: dict[str, torch.Tensor], capfd: pytest.CaptureFixture[str]
) -> None:
    """A foreign folder named step_9 (holding step 6 of another run) must not be resumed: the run would
    train steps 7-9 again and then die saving step 9 over it."""
    run_dir = root / "runs" / "foreign"
    _copy(root, "foreign")
    shutil.copytree(run_dir / "checkpoints" / "step_00000006", run_dir / "checkpoints" / "step_00000009")
    (result,) = run_distributed(
        train_rank, 1, args=(str(root), [*RUN, "--run.id=foreign", "--checkpoint.resume=true", "--train.max_steps=9"])
    )
    log = capfd.readouterr().err
    assert "step_00000009 holds step 6, not 9: a checkpoint of another run" in log
    assert re.search(r"resumed from \S*step_00000006", log)
    assert (run_dir / "checkpoints" / "step_00000009.foreign").is_dir()
    assert [p.name for p in list_checkpoints(run_dir)][-1] == "step_00000009"  # this run's own, saved at the end
    assert TrainerState.read(run_dir / "checkpoints" / "step_00000009").step == 9
    assert not all(torch.equal(result["params"][k], v) for k, v in reference_params.items())  # trained on
