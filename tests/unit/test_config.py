from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

from trainmesh.config import ConfigError, build_config, dump_toml, load_toml
from trainmesh.config.loader import config_to_dict, parse_override
from trainmesh.config.schema import SampleConfig
from trainmesh.job.spec import load_config
from trainmesh.recipes.gpt import GPTConfig


def test_defaults_then_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[optim]\nlr = 1e-3\nwarmup_steps = 5\n[train]\nprecision = "bf16-mixed"\n')
    config = load_config(path, ["--optim.lr=2e-3", "train.micro_batch=3"], "gpt")
    assert config.optim.lr == 2e-3  # override beats file
    assert config.optim.warmup_steps == 5  # file beats default
    assert config.optim.beta2 == 0.95  # default
    assert config.train.precision == "bf16-mixed" and config.train.micro_batch == 3
    assert isinstance(config.model, GPTConfig)


def test_override_values_are_toml_literals_or_strings() -> None:
    assert parse_override("--optim.lr=3e-4") == ("optim.lr", 3e-4)
    assert parse_override("--run.deterministic=true") == ("run.deterministic", True)
    assert parse_override("--train.precision=bf16-mixed") == ("train.precision", "bf16-mixed")
    assert parse_override("--data.source=/tmp/a b.txt") == ("data.source", "/tmp/a b.txt")
    with pytest.raises(ConfigError, match="--section.key=value"):
        parse_override("--lr=3")


def test_unknown_key_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'optim.lrr'.*Did you mean 'optim.lr'"):
        load_config(None, ["--optim.lrr=1"], "gpt")
    with pytest.raises(ConfigError, match=r"unknown config key 'trian'.*Did you mean 'train'"):
        load_config(None, ["--trian.max_steps=1"], "gpt")


def test_wrong_types_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"'train.micro_batch' expects an integer, got 'many'"):
        load_config(None, ["--train.micro_batch=many"], "gpt")
    with pytest.raises(ConfigError, match=r"'run.deterministic' expects true or false, got 3"):
        load_config(None, ["--run.deterministic=3"], "gpt")
    with pytest.raises(ConfigError, match=r"'optim.lr' expects a number"):
        load_config(None, ["--optim.lr=fast"], "gpt")


def test_value_checks_name_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"train.precision='fp8'.*32-true, bf16-mixed, 16-mixed, bf16-true"):
        load_config(None, ["--train.precision=fp8"], "gpt")
    with pytest.raises(ConfigError, match=r"model.n_embd=30 must be divisible by model.n_head=4"):
        load_config(None, ["--model.size=tiny", "--model.n_embd=30"], "gpt")
    with pytest.raises(ConfigError, match=r"parallel.ddp.comm_hook='zip'"):
        load_config(None, ["--parallel.ddp.comm_hook=zip"], "gpt")


def test_recipe_mismatch_and_unknown_recipe(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[run]\nrecipe = "resnet"\n')
    with pytest.raises(ConfigError, match="the command names recipe 'gpt' but the config has run.recipe='resnet'"):
        load_config(path, [], "gpt")
    with pytest.raises(ConfigError, match="unknown recipe 'bert'"):
        load_config(None, [], "bert")


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_toml(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim\nlr=")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)
    bad.write_bytes(b"[optim]\nlr = 1e-3 # \xff\n")  # not UTF-8
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)


def test_deeply_nested_toml_is_refused_in_one_line(tmp_path: Path) -> None:
    deep = tmp_path / "deep.toml"
    deep.write_text("a = " + "[" * 100_000)
    with pytest.raises(ConfigError, match="nests arrays or tables too deeply"):
        load_toml(deep)
    with pytest.raises(ConfigError, match="nested too deeply"):
        parse_override("--optim.lr=" + "[" * 100_000)


def test_resolved_config_round_trips_through_toml(tmp_path: Path) -> None:
    config = load_config(None, ["--optim.lr=1e-3", '--sample.prompt="a \\"quoted\\" line"'], "gpt")
    path = tmp_path / "resolved.toml"
    path.write_text(dump_toml(config_to_dict(config)))
    again = build_config(load_toml(path), GPTConfig)
    assert config_to_dict(again) == config_to_dict(config)


def test_shipped_configs_load() -> None:
    for path in Path(__file__).parents[2].joinpath("configs").glob("*.toml"):
        load_config(path, [], None)


def test_config_reference_is_up_to_date() -> None:
    from trainmesh.cli.reference import render

    doc = Path(__file__).parents[2] / "docs" / "config.md"
    assert doc.read_text() == render(), "regenerate: python -m trainmesh.cli.reference > docs/config.md"


def test_derived_values_are_filled_in_at_load_time(tmp_path: Path) -> None:
    assert load_config(None, [], "gpt").model.vocab_size == 256  # type: ignore[attr-defined]
    assert load_config(None, ["--model.vocab_size=300"], "gpt").model.vocab_size == 300  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"pre-tokenised shards.*Fix: set --model.vocab_size"):
        load_config(None, [f"--data.source={tmp_path}"], "gpt")  # a folder of shards: the config must say


@pytest.mark.parametrize(
    "odd", ["a\rb", "tab\there", "bell\x07", "nul\x00", 'quote"back\\slash', "é ü 中文", "\x7f", "\u2028"]
)
def test_the_written_config_reads_back_whatever_the_strings_hold(tmp_path: Path, odd: str) -> None:
    """A prompt with \\r or another control character once made a config.toml no worker could read."""
    config = replace(load_config(None, [], "gpt"), sample=SampleConfig(prompt=odd))
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(config_to_dict(config)))
    assert load_config(path, [], "gpt").sample.prompt == odd


def test_an_error_in_a_config_file_names_the_file_and_one_from_a_flag_names_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "exp.toml"
    path.write_text('[optim]\nlr = "fast"\n')
    with pytest.raises(ConfigError, match=r"^config file '.*exp.toml': config key 'optim.lr' expects a number"):
        load_config(path, [], "gpt")
    with pytest.raises(
        ConfigError, match=r"expects a number, got 'quick' \(str\) \(set on the command line: --optim.lr"
    ):
        load_config(path, ["--optim.lr=quick"], "gpt")
    path.write_text("[train]\nmicro_batchh = 4\n")
    with pytest.raises(ConfigError, match=r"^config file '.*exp.toml': unknown config key 'train.micro_batchh'"):
        load_config(path, [], "gpt")


def test_tri_state_options_are_true_false_or_unset() -> None:
    """optim.fused and model.hflip: true | false | unset ("auto", or left out), typed bool | None."""
    assert load_config(None, [], "gpt").optim.fused is None
    assert load_config(None, ["--optim.fused=auto"], "gpt").optim.fused is None
    assert load_config(None, ["--optim.fused=false"], "gpt").optim.fused is False
    assert load_config(None, ['--optim.fused="true"'], "gpt").optim.fused is True  # a string, as TOML files had it
    with pytest.raises(ConfigError, match=r"'optim.fused' expects true or false, or \"auto\" \(unset\), got 'maybe'"):
        load_config(None, ["--optim.fused=maybe"], "gpt")
    digits, folder = load_config(None, [], "resnet").model, load_config(None, ["--model.hflip=true"], "resnet").model
    assert (digits.hflip, folder.hflip) == (False, True)  # type: ignore[attr-defined]  # unset: by the data


def test_list_options_take_a_toml_array_or_a_comma_list(tmp_path: Path) -> None:
    """log.sinks, the first list-valued option: TOML arrays in a file or a flag, and plain words on a flag."""
    assert load_config(None, [], "gpt").log.sinks == ("tensorboard",)
    assert load_config(None, ['--log.sinks=["tensorboard","wandb"]'], "gpt").log.sinks == ("tensorboard", "wandb")
    assert load_config(None, ["--log.sinks=mlflow, wandb"], "gpt").log.sinks == ("mlflow", "wandb")
    assert load_config(None, ["--log.sinks=[]"], "gpt").log.sinks == ()
    assert load_config(None, ["--log.sinks="], "gpt").log.sinks == ()  # metrics.jsonl only
    path = tmp_path / "c.toml"
    path.write_text('[log]\nsinks = ["mlflow"]\ntags = ["baseline", "gpt 2"]\n')
    config = load_config(path, [], "gpt")
    assert config.log.sinks == ("mlflow",) and config.log.tags == ("baseline", "gpt 2")
    assert tomllib.loads(dump_toml(config_to_dict(config)))["log"]["sinks"] == ["mlflow"]  # config.toml: an array
    with pytest.raises(ConfigError, match=r"'log.tags\[1\]' expects a string, got \['b'\]"):
        load_config(None, ['--log.tags=["a", ["b"]]'], "gpt")
    with pytest.raises(ConfigError, match=r"'log.sinks' expects a list"):
        load_config(None, ["--log.sinks=3"], "gpt")


def test_an_unknown_sink_is_refused_with_the_allowed_ones_and_the_fix() -> None:
    with pytest.raises(ConfigError) as error:
        load_config(None, ["--log.sinks=tensorboard,wandbb"], "gpt")
    message = str(error.value)
    assert (
        "log.sinks=['tensorboard', 'wandbb'] names 'wandbb', which is not a metrics sink. Did you mean 'wandb'?"
        in message
    )
    assert "Choose any of: tensorboard, wandb, mlflow" in message
    assert """Fix: e.g. --log.sinks='["tensorboard","wandb"]'""" in message
    assert "(set on the command line: --log.sinks=...)" in message
    with pytest.raises(ConfigError, match="names a sink twice"):
        load_config(None, ["--log.sinks=wandb,wandb"], "gpt")
    with pytest.raises(ConfigError, match=r"log.tags: '-x' is not a tag"):
        load_config(None, ["--log.tags=-x"], "gpt")


def test_a_tracking_uri_with_a_password_is_refused_before_it_is_written_anywhere() -> None:
    with pytest.raises(ConfigError, match=r"log.mlflow_tracking_uri holds a password .* MLFLOW_TRACKING_PASSWORD"):
        load_config(None, ["--log.mlflow_tracking_uri=https://me:s3cret@mlflow.example.com"], "gpt")
    assert load_config(None, ["--log.mlflow_tracking_uri=https://mlflow.example.com"], "gpt").log.mlflow_tracking_uri
