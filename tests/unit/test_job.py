"""Resolve once: a frozen Job from config to worker; config.toml is what every checkpoint records."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from support import assert_config_recorded, nano_config
from trainmesh.config import ConfigError
from trainmesh.config.schema import ModelConfig, ParallelConfig
from trainmesh.core.env import DistEnv
from trainmesh.job.spec import load_config, resolve
from trainmesh.job.worker import run_worker
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import ParallelDims

TWO_RANKS = DistEnv(0, 0, 2, 2, "127.0.0.1", 1, "torchrun")


def test_a_job_holds_the_resolved_layout_batch_and_model_settings() -> None:
    config = load_config(None, ["--parallel.tp=2", "--train.micro_batch=4", "--train.global_batch=16"], "gpt")
    job = resolve(config, 4)
    assert job.layout == ("fsdp", ParallelDims(dp_shard=2, tp=2))  # auto with tp: fsdp
    assert (job.batch.dp_size, job.batch.accum_steps) == (2, 2)
    assert job.config.model.vocab_size == 256  # type: ignore[attr-defined]  # the byte tokenizer's
    assert job.config.model.n_layer == 4  # type: ignore[attr-defined]  # the size's, written out


def test_nothing_downstream_can_change_a_job() -> None:
    job = resolve(load_config(None, [], "gpt"), 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.config.train.max_steps = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.config.model.vocab_size = 1  # type: ignore[misc]
    named = job.named("exp1", resume=True)
    assert (named.run_id, named.resume) == ("exp1", True)
    assert (job.run_id, job.resume) == ("", False)  # a new Job; this one is unchanged


def test_a_runtime_built_in_code_gets_the_same_refusals_as_the_command_line() -> None:
    """16-mixed with tensor parallelism: `trainmesh check` and `Runtime(...)` refuse it with one message."""
    config = load_config(None, ["--parallel.tp=2", "--train.precision=16-mixed"], "gpt")
    with pytest.raises(ConfigError) as cli:
        resolve(config, 2)
    with pytest.raises(ValueError) as library:  # before any process group or device is touched
        Runtime(precision="16-mixed", parallel=ParallelConfig(tp=2), env=TWO_RANKS)
    assert str(library.value) == str(cli.value) and "--train.precision=bf16-mixed" in str(cli.value)


def test_config_toml_is_what_every_checkpoint_records(tmp_path: Path) -> None:
    """Also after a resume, which rewrites config.toml with checkpoint.resume=true."""
    run_dir = tmp_path / "runs" / "rec"
    overrides = ["--train.max_steps=4", "--checkpoint.every=2", "--checkpoint.final=true", "--run.id=rec"]
    run_worker(nano_config(tmp_path, *overrides), run_dir)
    assert assert_config_recorded(run_dir) == 2
    resumed = [*overrides, "--train.max_steps=6", "--checkpoint.resume=true"]
    run_worker(nano_config(tmp_path, *resumed), run_dir)
    assert "resume = true" in (run_dir / "config.toml").read_text()
    assert assert_config_recorded(run_dir, since_step=5) == 1  # step 6's: the checkpoints of this attempt


def test_a_key_of_an_earlier_version_says_what_it_became() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'run.name'. It was renamed: run.id .*--run-id"):
        load_config(None, ["--run.name=old"], "gpt")


def test_a_run_folder_of_any_name_still_trains(tmp_path: Path) -> None:
    """--run-dir (or a library caller) may name a folder that is no run id: run.id then stays as it was."""
    run_dir = tmp_path / "_scratch run"
    run_worker(nano_config(tmp_path, "--train.max_steps=2", "--checkpoint.final=true"), run_dir)
    assert assert_config_recorded(run_dir) == 1


def test_your_own_recipe_is_the_one_the_job_is_resolved_with(tmp_path: Path) -> None:
    """A recipe passed to run_worker decides the batch plan (here: 2 tokens per sample, not block_size)."""

    class Pairs(GPTRecipe):
        def tokens_per_sample(self, model: ModelConfig) -> int:
            return 2

    config = load_config(None, ["--train.micro_batch=4", "--train.global_batch_tokens=64"], "gpt")
    assert resolve(config, 1, recipe=Pairs()).batch.global_batch == 32
    with pytest.raises(ConfigError, match="not a whole number of sequences of 128 tokens"):
        resolve(config, 1)  # the built-in GPT's samples are block_size tokens long


def test_powersgd_is_refused_with_a_changing_loss_scale() -> None:
    """Its error feedback would keep gradients in the loss scale of their step (and take in overflows)."""
    config = load_config(None, ["--parallel.ddp.comm_hook=powersgd", "--train.precision=16-mixed"], "gpt")
    with pytest.raises(ConfigError, match=r"comm_hook='powersgd' with train.precision='16-mixed'.*bf16-mixed"):
        resolve(config, 2)
    resolve(load_config(None, ["--parallel.ddp.comm_hook=powersgd", "--train.precision=bf16-mixed"], "gpt"), 2)
