"""What a resume starts from (trainmesh.job.resume), how a run's config.toml is replaced (RunFolder.commit_config), and
the launch flags a printed resume command repeats (cli.flags.relaunch_tokens)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest

from support import nano_config
from trainmesh.checkpoint.state import TRAINER_STATE
from trainmesh.cli import invoked_as
from trainmesh.cli.flags import relaunch_tokens
from trainmesh.config import ConfigError, dump_toml
from trainmesh.config.loader import config_to_dict
from trainmesh.job.resume import RunStart, load_run_config
from trainmesh.job.rundir import CONFIG_FILE, RunFolder


def _recorded_run(root: Path, *overrides: str, step: int = 4) -> Path:
    """A run folder as a run with `overrides` leaves it: its config.toml and one checkpoint's trainer state."""
    config = nano_config(root, "--run.id=r", *overrides)
    run_dir = root / "runs" / "r"
    checkpoint = run_dir / "checkpoints" / f"step_{step:08d}"
    checkpoint.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(dump_toml(config_to_dict(config)))
    state = {"step": step, "samples_seen": 16, "world_size": 1, "config": config_to_dict(config)}
    (checkpoint / TRAINER_STATE).write_text(json.dumps(state))
    return run_dir


def _resume(root: Path, *overrides: str, path: Path | None = None, auto: bool = False) -> RunStart:
    command = [f"--run.out_dir={root / 'runs'}", "--run.id=r", *([] if auto else ["--checkpoint.resume=true"])]
    return load_run_config(path, [*command, *overrides], "gpt", auto_resume=auto)


def test_a_resume_starts_from_the_runs_config_with_the_command_line_on_top(tmp_path: Path) -> None:
    _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3", "--optim.lr=0.5")
    start = _resume(tmp_path, "--train.max_steps=9")
    config = start.config
    assert (config.model.n_embd, config.optim.lr, config.train.max_steps) == (48, 0.5, 9)
    assert start.changes == ("train.max_steps: 4 -> 9",)
    assert start.step == 4 and not start.finished
    assert config.checkpoint.resume  # this launch's decision, not the recorded one's


def test_a_config_file_given_with_resume_sets_only_its_own_keys(tmp_path: Path) -> None:
    _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    file = tmp_path / "more.toml"
    file.write_text("[optim]\nlr = 0.25\n")
    config = _resume(tmp_path, "--optim.lr=0.125", path=file).config
    assert (config.model.n_embd, config.optim.lr) == (48, 0.125)  # run < file < overrides
    assert _resume(tmp_path, path=file).config.optim.lr == 0.25


def test_auto_resume_uses_the_record_once_there_is_a_checkpoint_and_until_then_the_command(tmp_path: Path) -> None:
    assert _resume(tmp_path, auto=True).run_dir is None  # nothing there yet
    run_dir = _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    assert _resume(tmp_path, auto=True).config.model.n_embd == 48
    shutil.rmtree(run_dir / "checkpoints")  # an attempt that failed before its first checkpoint: rerun as given
    assert _resume(tmp_path, auto=True).config.model.n_embd != 48
    assert _resume(tmp_path).config.model.n_embd == 48  # --resume: the run's own, also from step 0
    plain = load_run_config(None, [f"--run.out_dir={tmp_path / 'runs'}", "--run.id=r"], "gpt")
    assert plain.run_dir is None and plain.config.model.n_embd != 48  # not asked to resume: a new config


def test_every_pinned_change_is_refused_naming_both_values_and_where_it_was_set(tmp_path: Path) -> None:
    _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    file = tmp_path / "shape.toml"
    file.write_text("[model]\nblock_size = 64\n")
    with pytest.raises(ConfigError) as refused:
        _resume(tmp_path, "--model.n_layer=3", path=file)
    message = str(refused.value)
    assert (
        "model.n_layer: the checkpoint has 2, this command gives 3 (--model.n_layer=... on the command line)" in message
    )
    assert f"model.block_size: the checkpoint has 32, this command gives 64 (set in --config {file})" in message
    assert "Fix: leave these keys out" in message


def test_the_checkpoint_is_compared_even_when_config_toml_was_edited_or_lost(tmp_path: Path) -> None:
    run_dir = _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    (run_dir / CONFIG_FILE).write_text('[model]\nsize = "nano"\nn_embd = 60\nn_head = 3\n')  # edited by hand
    with pytest.raises(ConfigError, match="model.n_embd: the checkpoint has 48, this command gives 60"):
        _resume(tmp_path)
    (run_dir / CONFIG_FILE).write_text("not [ toml")  # garbled: the checkpoint's record is the base
    assert _resume(tmp_path).config.model.n_embd == 48
    (run_dir / CONFIG_FILE).write_text("a = " + "[" * 100_000)  # hostile: nested past the parser's stack
    assert _resume(tmp_path).config.model.n_embd == 48
    (run_dir / CONFIG_FILE).unlink()
    assert _resume(tmp_path).config.model.n_embd == 48


def test_another_recipe_is_refused_with_the_command_that_resumes(tmp_path: Path) -> None:
    _recorded_run(tmp_path)
    command = [f"--run.out_dir={tmp_path / 'runs'}", "--run.id=r", "--checkpoint.resume=true"]
    with pytest.raises(ConfigError, match="Fix: trainmesh run gpt --resume --run-id r"):
        load_run_config(None, command, "resnet")


def test_a_finished_run_is_recognised(tmp_path: Path) -> None:
    _recorded_run(tmp_path, step=4)
    assert _resume(tmp_path).finished  # its max_steps is 4
    assert not _resume(tmp_path, "--train.max_steps=8").finished


def test_config_toml_is_replaced_keeping_the_one_it_replaces(tmp_path: Path) -> None:
    first, folder = nano_config(tmp_path), RunFolder(tmp_path)
    folder.commit_config(first, 0)
    folder.commit_config(dataclasses.replace(first), 4)  # the same config: no history
    assert not (tmp_path / "config_history").exists()
    longer = nano_config(tmp_path, "--train.max_steps=8")
    original = (tmp_path / CONFIG_FILE).read_bytes()
    folder.commit_config(longer, 4)
    assert (tmp_path / "config_history" / "step_00000004.toml").read_bytes() == original
    folder.commit_config(nano_config(tmp_path, "--train.max_steps=9"), 4)  # again from step 4
    assert (tmp_path / "config_history" / "step_00000004-2.toml").is_file()
    assert "max_steps = 9" in (tmp_path / CONFIG_FILE).read_text()


@pytest.mark.parametrize(
    ("argv", "kept"),
    [
        (
            ["run", "gpt", "--config", "c.toml", "--nproc-per-node", "2", "--run-id", "x", "--", "--train.max_steps=9"],
            ["run", "gpt", "--nproc-per-node", "2"],
        ),
        (
            ["run", "--config=c.toml", "gpt", "--run-id=x", "--auto-resume", "--nnodes", "2", "--rdzv-endpoint=h:1"],
            ["run", "gpt", "--nnodes", "2", "--rdzv-endpoint=h:1"],
        ),
        (["run", "gpt", "--resume", "--run-id=x", "--model.n_layer=3"], ["run", "gpt"]),
        (
            ["run", "gpt", "--auto", "--conf", "c.toml", "--run-i", "x", "--nproc_per_node=2"],
            ["run", "gpt", "--nproc_per_node=2"],
        ),
        (["run", "gpt", "--a", "--c", "c.toml", "--run-id", "x"], ["run", "gpt"]),  # argparse's shortest prefixes
    ],
)
def test_a_resume_command_repeats_the_launch_flags_as_typed(argv: list[str], kept: list[str]) -> None:
    assert relaunch_tokens(argv, [".venv/bin/trainmesh"]) == [".venv/bin/trainmesh", *kept]


def test_a_printed_command_names_the_program_as_it_can_be_run_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    program = tmp_path / "bin" / "trainmesh"
    program.parent.mkdir()
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    monkeypatch.setattr(sys, "argv", [str(program), "run", "gpt"])
    monkeypatch.setenv("PATH", "/usr/bin")
    assert invoked_as() == [str(program)]  # not on PATH (a venv not activated): the path it was run by
    monkeypatch.setenv("PATH", str(program.parent))
    assert invoked_as() == ["trainmesh"]
    monkeypatch.setattr(sys, "argv", ["pytest"])
    assert invoked_as() == [sys.executable, "-m", "trainmesh.cli"]


def test_resume_written_as_the_loader_reads_it_is_a_resume(tmp_path: Path) -> None:
    _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    command = [f"--run.out_dir={tmp_path / 'runs'}", "--run.id=r", "--checkpoint.resume=True"]
    assert load_run_config(None, command, "gpt").config.model.n_embd == 48


def test_a_record_from_another_version_loads_without_what_it_does_not_know(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    run_dir = _recorded_run(tmp_path, "--model.n_embd=48", "--model.n_head=3")
    text = (run_dir / CONFIG_FILE).read_text()
    (run_dir / CONFIG_FILE).write_text(text.replace("[run]\n", "[run]\nname = 'old'\n") + "[gone]\nx = 1\n")
    assert _resume(tmp_path).config.model.n_embd == 48
    assert "keys this trainmesh does not know, left out: run.name, gone" in caplog.text
    (run_dir / CONFIG_FILE).write_text(text.replace("log_every = 1", 'log_every = "often"'))
    with pytest.raises(ConfigError, match=r"run.log_every.*resuming run r from .*config.toml: correct it there"):
        _resume(tmp_path)
    assert _resume(tmp_path, "--run.log_every=5").config.run.log_every == 5  # or set on the command line


def test_a_new_run_is_recorded_once_and_never_over_an_existing_record(tmp_path: Path) -> None:
    RunFolder(tmp_path).record_new_run(nano_config(tmp_path))
    first = (tmp_path / CONFIG_FILE).read_bytes()
    RunFolder(tmp_path).record_new_run(nano_config(tmp_path, "--train.max_steps=99"))
    assert (tmp_path / CONFIG_FILE).read_bytes() == first


def test_a_run_id_that_reads_as_a_number_is_a_name(tmp_path: Path) -> None:
    from trainmesh.cli.flags import build_parser, split_recipe_args

    parser = build_parser()
    args = parser.parse_args(["run", "gpt", "--run-id", "0", "--resume"])
    overrides = split_recipe_args(parser, args)
    assert '--run.id="0"' in overrides
    config = nano_config(tmp_path, "--run.id=r")
    run_dir = tmp_path / "runs" / "0"
    run_dir.mkdir(parents=True)
    (run_dir / CONFIG_FILE).write_text(dump_toml(config_to_dict(config)).replace('id = "r"', 'id = "0"'))
    start = load_run_config(None, [f"--run.out_dir={tmp_path / 'runs'}", *overrides], "gpt")
    assert start.run_dir == run_dir  # its own config: not the defaults
