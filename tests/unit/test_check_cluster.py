"""`trainmesh check --cluster`: a job's memory per rank against the devices it is for, not this machine's; a
multi-node job checked without it says so; bad flags are refused before anything is resolved."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from support import nano_toml
from trainmesh.apps.plan import check
from trainmesh.apps.plan.check import choose_gradient_mode
from trainmesh.apps.plan.cluster import PRESETS, get_cluster, load_calibration, save_calibration
from trainmesh.cli import main
from trainmesh.job.spec import load_config, resolve

pytestmark = pytest.mark.timeout(120)


def _check(tmp_path: Path, *extra: str) -> list[str]:
    return ["check", "gpt", "--config", str(nano_toml(tmp_path)), "--nproc-per-node", "2", *extra]


def test_memory_is_compared_with_the_target_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = tmp_path / "tiny.json"  # a cluster of 1 MB devices: the nano GPT's few MB per rank exceed them
    save_calibration(dataclasses.replace(PRESETS["h100"], name="tiny", memory=1e6, overhead=0.0), tiny)
    assert main(_check(tmp_path, "--cluster", str(tiny))) == 0
    out = capsys.readouterr().out
    assert "WARNING: that is more than the 0.0 GiB usable of the 0.0 GiB of memory per cuda rank of tiny" in out
    assert main(_check(tmp_path, "--cluster", "h100")) == 0
    assert "WARNING" not in capsys.readouterr().out  # 80 GiB devices hold it


def test_a_multi_node_job_checked_here_says_whose_devices(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"]
    assert main(_check(tmp_path, *args)) == 0
    assert "memory against this machine's devices: add --cluster h100" in capsys.readouterr().out
    assert main(_check(tmp_path, *args, "--cluster", "a100")) == 0
    assert "this machine's devices" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--cluster", "tpu"], "--cluster='tpu' is not one of a100, h100, h200, this, nor a .json file"),
        (["--memory-margin", "1"], "--memory-margin=1.0: the fraction of device memory kept free"),
    ],
)
def test_bad_check_flags_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, extra: list[str], message: str
) -> None:
    assert main(_check(tmp_path, *extra)) == 2
    assert message in caplog.text


def test_a_cluster_file_keeps_its_margin_and_span(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    save_calibration(dataclasses.replace(PRESETS["a100"], memory_margin=0.2), path)
    data = json.loads(path.read_text())
    assert data["memory_margin"] == 0.2 and data["efficiency_range"] == [0.31, 0.6]
    back = load_calibration(path)
    assert back.memory_margin == 0.2 and back.efficiency_range == (0.31, 0.6)
    del data["memory_margin"], data["efficiency_range"]  # a file written before these keys
    path.write_text(json.dumps(data))
    old = load_calibration(path)
    assert old.memory_margin == 0.1 and old.efficiency_range == ()


SEVEN_B = (
    *("--model.n_layer=32", "--model.n_head=32", "--model.n_embd=4096", "--model.vocab_size=32000"),
    *("--model.block_size=4096", "--train.precision=bf16-mixed", "--train.global_batch_tokens=0"),
    "--parallel.strategy=fsdp",
)


@pytest.mark.parametrize(("micro_batch", "every"), [(1, False), (3, True)])
def test_auto_gradient_mode_holds_whole_gradients_only_where_they_fit(micro_batch: int, every: bool) -> None:
    """7B on 64 H100s, 12 sequences per rank: at micro-batch 1 whole gradients fit (44 GiB of 72) and save the
    per-micro-step reduce-scatters; at 3 the activations triple and only sharded gradients fit (55 GiB; whole: 79)."""
    overrides = [*SEVEN_B, "--train.global_batch=768", f"--train.micro_batch={micro_batch}"]
    config = load_config(None, overrides, "gpt")
    assert config.parallel.fsdp.reduce_every_microstep is None  # auto by default
    jobs, why = choose_gradient_mode([resolve(config, 64), resolve(config, 128)], get_cluster("h100", 8, 8))
    assert [job.config.parallel.fsdp.reduce_every_microstep for job in jobs] == [every, every]
    assert why.startswith(f"parallel.fsdp.reduce_every_microstep=auto: {str(every).lower()} — whole gradients")
    assert "usable 72.00 GiB of h100" in why


def test_auto_gradient_mode_leaves_a_given_mode_and_says_nothing_where_nothing_is_decided() -> None:
    cluster = get_cluster("h100", 8, 8)
    given = ["--train.global_batch=1024", "--train.micro_batch=1", "--parallel.fsdp.reduce_every_microstep=true"]
    jobs, why = choose_gradient_mode([resolve(load_config(None, [*SEVEN_B, *given], "gpt"), 64)], cluster)
    assert jobs[0].config.parallel.fsdp.reduce_every_microstep is True and why == ""  # auto would pick false
    one_step = ["--train.global_batch=1024", "--train.micro_batch=16"]  # no accumulation at 64 ranks
    jobs, why = choose_gradient_mode([resolve(load_config(None, [*SEVEN_B, *one_step], "gpt"), 64)], cluster)
    assert jobs[0].config.parallel.fsdp.reduce_every_microstep is False and why == ""


@pytest.mark.parametrize(
    "layout",
    [
        ["--parallel.strategy=ddp"],  # no sharding
        ["--train.micro_batch=16"],  # no accumulation at 64 ranks
        ["--parallel.pp=2", "--parallel.pipeline.microbatches=4"],  # a pipeline's stages reduce every micro-step
    ],
)
def test_auto_gradient_mode_estimates_nothing_where_the_mode_changes_nothing(
    layout: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every launch decides the mode; estimating builds the model on the meta device twice (a second of start-up),
    which is spent only where fsdp shards over ranks and accumulates without a pipeline."""
    monkeypatch.setattr(check, "predict", lambda job, cluster: pytest.fail(f"estimated {job.layout}"))
    job = resolve(load_config(None, [*SEVEN_B, "--train.global_batch=1024", *layout], "gpt"), 64)
    assert not job.gradient_mode_matters
    jobs, why = choose_gradient_mode([job], get_cluster("h100", 8, 8))
    assert jobs[0].config.parallel.fsdp.reduce_every_microstep is False and why == ""
