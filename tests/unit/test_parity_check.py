"""`trainmesh check --parity` without launching anything: the fingerprints, the comparison (which step and which
parameter come first, tolerances from the spread and the dtype) and every refusal of bad input."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from support import nano_toml, refused_before_writing
from trainmesh.apps.parity.compare import SPREAD_FACTOR, ParityError, Record, compare, tolerance_floor
from trainmesh.apps.parity.report import report_text
from trainmesh.train.parity import L2, SUM, WSUM, fingerprint, relative_difference

pytestmark = pytest.mark.timeout(60)

ORDER = ["wte.weight", "blocks.0.fc.weight", "blocks.0.fc.bias", "head.weight"]  # not alphabetical


def _digest(scale: float) -> list[float]:
    return [0.5 * scale, 2.0 * scale, 1.0 * scale, 0.25 * scale]


def _record(steps: int = 4, compute: str = "float32") -> Record:
    params = {name: {"shape": [4], "dtype": "float32"} for name in ORDER}
    lines: list[dict[str, Any]] = [{"step": 0, "weights": {n: _digest(1.0 + i) for i, n in enumerate(ORDER)}}]
    for s in range(1, steps + 1):
        lines.append(
            {
                "step": s,
                "loss": 5.0 - s,
                "grad_norm": 1.0 + s,
                "grads": {n: _digest(0.1 * s + i) for i, n in enumerate(ORDER)},
                "weights": {n: _digest(1.0 + i + 0.01 * s) for i, n in enumerate(ORDER)},
                "replicas": {},
            }
        )
    return Record(1, "single", compute, params, list(ORDER), lines)


def _scaled(record: Record, step: int, kind: str, name: str, factor: float, checksum: int = L2) -> Record:
    changed = copy.deepcopy(record)
    changed.steps[step][kind][name][checksum] *= factor
    return changed


def test_equal_runs_are_equal_and_the_report_says_so() -> None:
    a = _record()
    result = compare(a, copy.deepcopy(a), copy.deepcopy(a))
    assert result.equal and result.first is None and len(result.rows) == 5
    assert result.order == ORDER
    text = report_text(result, "A: 1 process", "B: 2 processes")
    assert "EQUAL within tolerance" in text and "all 4 parameters" in text
    assert "spread: B again did not move from B" in text


def test_the_first_divergence_is_the_earliest_step_then_the_first_parameter_in_execution_order() -> None:
    a = _record()
    b = _scaled(a, 3, "grads", "blocks.0.fc.bias", 1.5)  # later in execution order, earlier by name
    b = _scaled(b, 3, "grads", "blocks.0.fc.weight", 1.5)
    b = _scaled(b, 3, "weights", "wte.weight", 1.5)  # weights come after every gradient of the step
    b = _scaled(b, 4, "grads", "wte.weight", 1.5)  # a later step
    result = compare(a, b, copy.deepcopy(b))
    first = result.first
    assert first is not None and result.first_param is first
    assert (first.step, first.what, first.param, first.index) == (3, "gradient", "blocks.0.fc.weight", 1)
    assert first.difference == pytest.approx(1 / 3) and first.tolerance == pytest.approx(64 * 2.0**-23)
    assert [r.over for r in result.rows] == [0, 0, 0, 3, 1]
    text = report_text(result, "A", "B")
    assert "DIVERGED at step 3: the gradient of blocks.0.fc.weight (parameter 2 of 4 in execution order)" in text


def test_the_loss_comes_first_and_the_first_parameter_is_still_named() -> None:
    a = _record()
    b = copy.deepcopy(a)
    b.steps[2]["loss"] *= 1.01
    b = _scaled(b, 2, "grads", "head.weight", 2.0, checksum=WSUM)
    result = compare(a, b, copy.deepcopy(b))
    assert result.first is not None and result.first_param is not None
    assert (result.first.step, result.first.what) == (2, "loss")
    assert (result.first_param.param, result.first_param.checksum) == ("head.weight", "wsum")
    assert "first parameter: the gradient of head.weight" in report_text(result, "A", "B")


def test_the_tolerance_is_a_multiple_of_the_widest_spread_of_its_kind_so_far() -> None:
    a = _record()

    def b_and_again(d: float, name: str = "wte.weight", kind: str = "grads") -> tuple[Record, Record]:
        b = _scaled(a, 2, kind, name, 1 + d)
        return b, _scaled(b, 2, "grads", "wte.weight", 1 + 1e-4)  # B again moved 1e-4 in one gradient's L2

    within, beyond = 0.8 * SPREAD_FACTOR * 1e-4, 1.2 * SPREAD_FACTOR * 1e-4
    assert compare(a, *b_and_again(within)).equal
    result = compare(a, *b_and_again(beyond))
    assert result.first is not None and result.first.param == "wte.weight"
    assert result.first.tolerance == pytest.approx(SPREAD_FACTOR * 1e-4, rel=1e-2)
    wide = result.widest_spread
    assert wide is not None and (wide.step, wide.param, wide.spread) == (2, "wte.weight", pytest.approx(1e-4, rel=1e-3))
    assert "spread: B again moved from B by up to 1.00e-04 (step 2, gradient of wte.weight (l2))" in report_text(
        result, "A", "B"
    )
    assert compare(a, *b_and_again(within, "head.weight")).equal  # any gradient, any checksum: the same spread
    assert not compare(a, *b_and_again(within, "head.weight", "weights")).equal  # the weights did not spread
    for step, equal in ((1, False), (4, True)):  # the widest spread so far: not before step 2, still after it
        b = _scaled(a, step, "grads", "blocks.0.fc.bias", 1 + within, checksum=SUM)
        assert compare(a, b, _scaled(b, 2, "grads", "wte.weight", 1 + 1e-4)).equal is equal


def test_a_spread_that_is_not_finite_leaves_the_floor_in_force() -> None:
    """B again overflowing where B did not measures no spread: a later divergence of that kind is still caught."""
    a = _record()
    b = _scaled(a, 3, "grads", "head.weight", 1 + 1e-3)
    again = _scaled(b, 2, "grads", "wte.weight", float("inf"))
    result = compare(a, b, again)
    assert result.first is not None and (result.first.step, result.first.param) == (3, "head.weight")


def test_the_floor_comes_from_the_least_precise_dtype_or_the_flag() -> None:
    a, bf16 = _record(), _record(compute="bfloat16")
    assert tolerance_floor(a) == (pytest.approx(64 * 2.0**-23), "64 × eps of float32")
    assert tolerance_floor(a, bf16) == (pytest.approx(4 * 2.0**-7), "4 × eps of bfloat16")
    b = _scaled(a, 1, "weights", "head.weight", 1 + 1e-6)  # rounding-sized: under the fp32 floor
    assert compare(a, b, copy.deepcopy(b)).equal
    strict = compare(a, b, copy.deepcopy(b), floor=1e-7)
    assert strict.first is not None and (strict.first.what, strict.first.tolerance) == ("weight", 1e-7)
    b = _scaled(bf16, 1, "weights", "head.weight", 1.01)  # within bf16's rounding
    assert compare(bf16, b, copy.deepcopy(b)).equal


def test_sums_are_measured_against_the_l1_norm_so_cancellation_is_not_a_difference() -> None:
    x = torch.tensor([1.0, -1.0, 0.5, -0.5], dtype=torch.float64)
    a, b = fingerprint(x).tolist(), fingerprint(x + torch.tensor([1e-9, 0, 0, 0], dtype=torch.float64)).tolist()
    assert abs(a[SUM]) < 1e-12  # the sum cancels: relative to itself the difference would be enormous
    assert relative_difference(a, b, SUM) == pytest.approx(1e-9 / 3, rel=1e-3)
    assert relative_difference([math.nan] * 4, [math.nan] * 4, L2) == 0.0
    assert relative_difference([math.inf] * 4, [1.0] * 4, L2) == math.inf


def test_the_weighted_sum_sees_elements_that_trade_places() -> None:
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    same, swapped = fingerprint(x).tolist(), fingerprint(x.flip(0)).tolist()
    assert [relative_difference(same, swapped, c) for c in (SUM, L2)] == [0.0, 0.0]
    assert relative_difference(same, swapped, WSUM) > 1e-3


def test_copies_that_disagree_within_one_run_are_a_divergence() -> None:
    a = _record()
    b = copy.deepcopy(a)
    b.steps[3]["replicas"] = {"grads": {"head.weight": [1, 0.5]}}
    result = compare(a, b, copy.deepcopy(a), labels=("A", "B", "B"))
    first = result.first
    assert first is not None and (first.step, first.param, first.run, first.rank) == (3, "head.weight", "B", 1)
    assert "rank 1's copy in B differs" in report_text(result, "A", "B")


def test_runs_of_different_models_are_not_compared() -> None:
    a = _record()
    b = copy.deepcopy(a)
    b.params["head.weight"] = {"shape": [4], "dtype": "bfloat16"}  # another precision: comparable
    assert compare(a, b, b).equal
    b.params["head.weight"] = {"shape": [5], "dtype": "float32"}
    with pytest.raises(ParityError, match=r"trained different models \(parameters head.weight differ"):
        compare(a, b, b)


def _refused(tmp_path: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    return refused_before_writing(tmp_path, capsys, "check", "gpt", "--config", str(nano_toml(tmp_path)), *flags)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--parity-steps", "3", "--parity-b=x.y=1"], ["--parity-steps, --parity-b: only with --parity"]),
        (["--parity", "--parity-steps", "0"], ["--parity-steps=0: must be at least 1"]),
        (["--parity", "--resume"], ["--resume cannot go with --parity"]),
        (["--parity", "--nproc-per-node", "1"], ["is one. Fix: --nproc-per-node 2 (or more)"]),
        (["--parity", "--parity-b", "parallel.strategy"], ["'parallel.strategy' is not an override"]),
        (["--parity", "--parity-b=train.max_steps=3"], ["the parity check sets train.max_steps itself"]),
        (["--parity", "--parity-a", "optim.lr='0.1"], ['--parity-a="optim.lr=\'0.1" cannot be split', "No closing"]),
        (["--parity", "--parity-b=optim.lrr=1"], ["--parity-b: ", "Did you mean 'optim.lr'"]),
        (["--parity", "--parity-b=model.n_layer=3"], ["the sides differ in model.n_layer"]),
        (["--parity", "--parity-b=train.micro_batch=2"], ["different global batches", "--train.global_batch=N"]),
        (["--parity", "--", "--model.dropout=0.1"], ["model.dropout=0.1: each rank draws its own dropout masks"]),
        (["--parity", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400"], ["runs on one node"]),
        (["--parity", "--parity-rtol=-1"], ["--parity-rtol=-1.0: a relative tolerance is 0 or more"]),
        (["--parity", "--parity-rtol=inf"], ["--parity-rtol=inf: a relative tolerance is 0 or more"]),
        (["--parity", "--", "--train.max_steps=50"], ["after --): the parity check sets train.max_steps itself"]),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: list[str]
) -> None:
    err = _refused(tmp_path, capsys, *flags)
    for text in said:
        assert text in err, err


def test_b_again_is_nudged_so_the_check_measures_a_spread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The three runs trained in this process (one process each): B again must get its noise, else the spread is
    0 and every tolerance falls to the floor (a CPU run repeated as it was is exact)."""
    from trainmesh.cli import main
    from trainmesh.cli import parity as command
    from trainmesh.job.worker import run_worker

    def launch_here(opts: Any, jobs: Any, job: Any, folder: Any) -> int:
        run_worker(job.config, folder.path)  # the probe reads the environment the launch would pass on
        return 0

    monkeypatch.setattr(command, "launch_into", launch_here)
    same = "--parity-a=optim.weight_decay=0.05", "--parity-b=optim.weight_decay=0.05"
    args = ["check", "gpt", "--config", str(nano_toml(tmp_path)), "--parity", "--parity-steps", "2", *same]
    assert main([*args, "--nproc-per-node", "1"]) == 0, capsys.readouterr().err[-3000:]
    (report,) = (tmp_path / "runs").glob("gpt-parity-*/parity.json")
    widest = json.loads(report.read_text())["widest_spread"]
    assert widest is not None and widest["spread"] > 0, "B again did not move from B: it ran without its noise"
