"""Pipeline and tensor parallelism equal one process: every pipeline schedule, pipeline × DDP and
pipeline × FSDP, tensor parallel alone, TP × FSDP (2-D) and PP × FSDP × TP (3-D) reach the parameters
of a single process on the same global batch after 4 AdamW steps (fp32, nano GPT with 4 blocks), and
report the same loss. Checkpoints move between pipeline, tensor parallel and one process.

Tolerance: atol 1e-4, rtol 1e-4. The arithmetic differs in summation order (micro-batches of the
schedule, partial sums of the row-parallel layers), and Adam divides by the root of the second moment,
so a parameter whose gradient is near zero can move by up to a few 1e-5 differently after 4 steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from support import assert_same_training, train_rank, train_rank_runs
from trainmesh.strategies import SCHEDULES
from trainmesh.testing import run_distributed

pytestmark = pytest.mark.slow

ATOL, RTOL = 1e-4, 1e-4
BASE = ["--train.global_batch=8", "--model.dropout=0.0", "--model.n_layer=4", "--train.max_steps=4"]
PP = ["--parallel.pp=2", "--parallel.pipeline.microbatches=4"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mp-ref")
    overrides = [*BASE, "--train.micro_batch=8", "--parallel.strategy=single", "--run.id=ref"]
    return run_distributed(train_rank, 1, args=(str(root), overrides))[0]


def _whole(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The model's parameters put together from every rank's part (pipeline stages hold some)."""
    merged: dict[str, torch.Tensor] = {}
    for result in ranks:
        for key, value in result["params"].items():
            assert key not in merged or torch.equal(merged[key], value), f"ranks disagree on {key}"
            merged[key] = value
    return merged


def _assert_matches(ranks: list[dict[str, Any]], reference: dict[str, Any], what: str) -> None:
    params = _whole(ranks)
    assert params.keys() == reference["params"].keys(), what
    for key, ref in reference["params"].items():
        torch.testing.assert_close(params[key], ref, atol=ATOL, rtol=RTOL, msg=f"{what}: {key}")
    for result in ranks:  # the loss is reported from the last stage, counted once per replica
        assert result["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-5), what
        assert result["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-5), what
    assert_same_training(ranks[0], reference, what)  # every logged step: loss and gradient norm


def test_every_pipeline_schedule_and_tensor_parallel_equal_one_process(
    reference: dict[str, Any], tmp_path: Path
) -> None:
    runs = {f"pp {name}": [*PP, f"--parallel.pipeline.schedule={name}"] for name in SCHEDULES}
    runs["tp 2"] = ["--parallel.tp=2"]
    overrides = [[*BASE, "--train.micro_batch=8", *extra, f"--run.id=r{i}"] for i, extra in enumerate(runs.values())]
    per_rank = run_distributed(train_rank_runs, 2, args=(str(tmp_path), overrides), timeout_s=60)
    for i, name in enumerate(runs):
        ranks = [per_rank[0][i], per_rank[1][i]]
        _assert_matches(ranks, reference, name)
        if name.startswith("pp"):  # each rank held a part only: the blocks are split between them
            held = [{k for k in r["params"] if k.startswith("blocks.")} for r in ranks]
            assert held[0] and held[1] and not held[0] & held[1], name
        else:
            assert {"blocks.0.attn.qkv.weight", "wte.weight"} <= set(ranks[0]["sharded"]), name
        if name in ("pp gpipe", "pp zbv_zero_bubble"):  # the weight tied across stages stays one value
            whole = _whole(ranks)
            assert torch.equal(whole["wte.weight"], whole["lm_head.weight"]), name


def test_pipeline_and_tensor_parallel_with_uneven_target_counts(tmp_path: Path) -> None:
    """Micro-batches whose target counts differ (ignore_index padding): the loss is normalised by the
    global batch's count whether the stages, the pipeline's pieces or tensor-parallel ranks compute it."""
    single = [*BASE, "--train.micro_batch=8", "--parallel.strategy=single", "--run.id=ref"]
    (reference,) = run_distributed(train_rank_runs, 1, args=(str(tmp_path), [single], True))
    runs = {"pp 1f1b": PP, "tp 2": ["--parallel.tp=2"]}  # 2 micro-steps of 4 (with different counts) per step
    overrides = [[*BASE, "--train.micro_batch=4", *extra, f"--run.id=u{i}"] for i, extra in enumerate(runs.values())]
    per_rank = run_distributed(train_rank_runs, 2, args=(str(tmp_path), overrides, True), timeout_s=60)
    for i, name in enumerate(runs):
        _assert_matches([per_rank[0][i], per_rank[1][i]], reference[0], f"{name}, uneven target counts")


def test_pipeline_with_ddp_or_fsdp_and_tp_with_fsdp_on_4_ranks(reference: dict[str, Any], tmp_path: Path) -> None:
    runs = {
        "pp 2 × ddp 2": [*PP, "--parallel.strategy=ddp"],
        "pp 2 × fsdp 2": [*PP, "--parallel.strategy=fsdp"],
        "fsdp 2 × tp 2": ["--parallel.strategy=fsdp", "--parallel.tp=2"],
    }
    overrides = [[*BASE, "--train.micro_batch=4", *extra, f"--run.id=r{i}"] for i, extra in enumerate(runs.values())]
    per_rank = run_distributed(train_rank_runs, 4, args=(str(tmp_path), overrides), timeout_s=60)
    for i, name in enumerate(runs):
        _assert_matches([results[i] for results in per_rank], reference, name)
    tp_fsdp = per_rank[0][2]["sharded"]
    assert "blocks.0.mlp.fc.weight" in tp_fsdp and "ln_f.weight" in tp_fsdp  # fsdp shards what tp does not


def test_three_dimensions_pp_fsdp_tp_on_8_ranks(reference: dict[str, Any], tmp_path: Path) -> None:
    overrides = [*BASE, "--train.micro_batch=4", *PP, "--parallel.strategy=fsdp", "--parallel.tp=2", "--run.id=3d"]
    ranks = run_distributed(train_rank, 8, args=(str(tmp_path), overrides), timeout_s=60)
    _assert_matches(ranks, reference, "pp 2 × fsdp 2 × tp 2")


def test_checkpoints_move_between_pipeline_tensor_parallel_and_one_process(tmp_path: Path) -> None:
    """Saved by 2 pipeline stages at step 2, resumed by one process; saved by 2 tensor-parallel ranks at
    step 2, resumed by 2 pipeline stages: each continuation equals the uninterrupted pipeline run (DCP
    reads every parameter by name, whole or in parts)."""
    steps = [*BASE, "--train.micro_batch=8", "--checkpoint.every=2"]
    cut = "--train.max_steps=2", "--checkpoint.final=true"  # stopped after step 2, with its checkpoint
    runs = [
        [*steps, *PP, "--run.id=full"],
        [*steps, *PP, "--run.id=pp-cut", *cut],
        [*steps, "--parallel.tp=2", "--run.id=tp-cut", *cut],
        [*steps, *PP, "--run.id=tp-cut", "--checkpoint.resume=true"],
    ]
    full, _, _, from_tp = zip(*run_distributed(train_rank_runs, 2, args=(str(tmp_path), runs)), strict=True)
    uninterrupted = {**full[0], "params": _whole(list(full))}
    _assert_matches(list(from_tp), uninterrupted, "tp 2 -> pp 2")
    resumed = [*steps, "--run.id=pp-cut", "--checkpoint.resume=true", "--parallel.strategy=single"]
    single = run_distributed(train_rank, 1, args=(str(tmp_path), resumed))[0]
    _assert_matches([single], uninterrupted, "pp 2 -> single")
    for name in ("tp-cut", "pp-cut"):  # each continued from step 2 (a fresh start would log 1, 2 again)
        records = [json.loads(r) for r in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2, 3, 4], name


def test_models_built_on_the_meta_device_train_like_whole_ones(reference: dict[str, Any], tmp_path: Path) -> None:
    """parallel.meta_init=true: each rank gives storage only to its shards or stages and initialises
    them from per-parameter random streams, so training matches the whole model built on one process."""
    meta = "--parallel.meta_init=true"
    runs = {
        "fsdp 4, meta": ["--parallel.strategy=fsdp", "--train.micro_batch=2"],
        "pp 2 × tp 2, meta": [*PP, "--parallel.tp=2", "--train.micro_batch=8"],
    }
    overrides = [[*BASE, meta, *extra, f"--run.id=m{i}"] for i, extra in enumerate(runs.values())]
    per_rank = run_distributed(train_rank_runs, 4, args=(str(tmp_path), overrides), timeout_s=60)
    for i, name in enumerate(runs):
        ranks = [results[i] for results in per_rank]
        _assert_matches(ranks, reference, name)
        assert "blocks.0.attn.qkv.weight" in ranks[0]["sharded"], name
