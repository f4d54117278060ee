"""Background checkpoint saves, one process: several saves in a run, whatever the torch version's stager does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.staging import DefaultStager

from support import nano_config
from trainmesh.checkpoint import list_checkpoints, saver
from trainmesh.job.worker import run_worker


def test_saver_survives_a_stager_that_clears_itself_after_each_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.11's DefaultStager closes its StateDictStager after every stage, which empties its copier table:
    a second stage by the same stager then fails with KeyError: <class 'type'> (seen on an H100). Mirror that
    here; three saves in one run must all commit."""
    original = DefaultStager._stage

    def stage_then_close(self: DefaultStager, state_dict: Any, **kwargs: Any) -> Any:
        staged = original(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)
    monkeypatch.setattr(saver, "FRESH_STAGER_PER_SAVE", True)  # what the saver does on such a torch
    overrides = ["--checkpoint.async_save=true", "--checkpoint.every=2", "--train.max_steps=6", "--run.id=a"]
    run_worker(nano_config(tmp_path, *overrides, "--checkpoint.final=true"), tmp_path / "runs" / "a")
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "a")] == [f"step_0000000{s}" for s in (2, 4, 6)]


def test_one_stager_serves_every_save_where_torch_keeps_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From torch 2.13 on, the stager keeps its (pinned) CPU copies between saves: one is made per run."""
    made: list[DefaultStager] = []
    original = DefaultStager.__init__

    def counted(self: DefaultStager, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(DefaultStager, "__init__", counted)
    monkeypatch.setattr(saver, "FRESH_STAGER_PER_SAVE", False)
    overrides = ["--checkpoint.async_save=true", "--checkpoint.every=2", "--train.max_steps=6", "--run.id=b"]
    run_worker(nano_config(tmp_path, *overrides, "--checkpoint.final=true"), tmp_path / "runs" / "b")
    assert len(list_checkpoints(tmp_path / "runs" / "b")) == 3 and len(made) == 1
