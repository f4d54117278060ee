"""The Runtime's constructor: `dist_config=` (and `dist=`, its old name, for one release), and each check of a
worker's path done once per process: the layout's combinations (`check_layout`) and the recipe's completion of the
model settings (`complete_model`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

import trainmesh.job.spec
import trainmesh.runtime.runtime
from trainmesh.config.schema import Config, DistConfig, ModelConfig
from trainmesh.job.spec import load_config, resolve
from trainmesh.recipes.gpt import GPTRecipe
from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import check_layout

CPU = DistConfig(device="cpu")


def test_dist_config_names_the_dist_section() -> None:
    with Runtime(strategy="single", dist_config=CPU) as rt:
        assert rt.device.type == "cpu"


def test_the_old_keyword_still_works_and_names_the_new_one() -> None:
    with pytest.warns(DeprecationWarning, match=r"Runtime\(dist=\.\.\.\) is deprecated.*Runtime\(dist_config=\.\.\.\)"):
        rt = Runtime(strategy="single", dist=CPU)
    assert rt.device.type == "cpu"
    with pytest.raises(TypeError, match="both dist_config= and dist="):
        Runtime(strategy="single", dist_config=CPU, dist=CPU)


def test_a_worker_checks_its_layout_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve checks the Job's layout; job.runtime() takes it as checked. Runtime(...) alone checks its own."""
    calls: list[str] = []

    def counted(*args: Any) -> None:
        calls.append("check")
        check_layout(*args)

    monkeypatch.setattr(trainmesh.job.spec, "check_layout", counted)
    monkeypatch.setattr(trainmesh.runtime.runtime, "check_layout", counted)
    job = resolve(load_config(None, ["--dist.device=cpu"], "gpt"), 1)
    job.runtime().teardown()
    assert calls == ["check"]
    Runtime(strategy="single", dist_config=CPU).teardown()
    assert calls == ["check", "check"]


def test_a_config_is_completed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_config completes the model settings and resolve takes them as they are; a config built in code is
    completed by resolve."""
    calls: list[str] = []
    complete = GPTRecipe.complete_model

    def counted(self: GPTRecipe, config: Config) -> ModelConfig:
        calls.append("complete")
        return complete(self, config)

    monkeypatch.setattr(GPTRecipe, "complete_model", counted)
    config = load_config(None, [], "gpt")
    resolve(config, 1)
    resolve(config, 2)
    assert calls == ["complete"]
    in_code = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=0))
    assert resolve(in_code, 1).config.model.vocab_size == 256  # type: ignore[attr-defined]  # the byte tokenizer's
    assert calls == ["complete", "complete"]


def test_a_config_holding_a_list_resolves_and_completes_once() -> None:
    """Completing is remembered by identity: a config built in code may hold lists (not hashable)."""
    from trainmesh.config.schema import LogConfig

    config = load_config(None, [], "resnet")
    listed = dataclasses.replace(config, log=LogConfig(sinks=["tensorboard"]))  # type: ignore[arg-type]
    assert resolve(listed, 1).config.log.sinks == ["tensorboard"]


def test_a_user_loop_reads_its_data_parallel_place() -> None:
    rt = Runtime(strategy="single", dist_config=DistConfig(device="cpu"))
    assert (rt.dp_size, rt.dp_rank) == (1, 0)
