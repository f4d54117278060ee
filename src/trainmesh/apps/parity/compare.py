"""Two recorded runs compared step by step and parameter by parameter (`trainmesh check --parity`): each quantity's
difference against a tolerance set by how far rounding alone carries the training, and the first divergence.

Details: docs/internals.md#appsparitycomparepy
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from trainmesh.core.errors import UserError
from trainmesh.train.parity import L2, SUM, WSUM, Digest, relative_difference, scalar_difference

SPREAD_FACTOR = 10.0
"""The tolerance in units of the spread: the spread is one sample of noise, A against B another."""
FLOOR_UNITS = {"float64": 64, "float32": 64, "bfloat16": 4, "float16": 4}
"""The floor in units of the dtype's machine epsilon: what two orders of summation leave after one step (fp32: 64
units, 7.6e-6, over the ~1e-7 measured); 16-bit formats round so coarsely that a few units already hide much
(bf16: 4 units, 3.1e-2; fp16: 3.9e-3). Not measured on a GPU."""
COMPARED = {"sum": SUM, "l2": L2, "wsum": WSUM}
"""The checksums compared (L1 only scales the sums)."""


class ParityError(UserError, ValueError):
    """Runs that cannot be compared, or parity flags that cannot work; the message says what to fix."""


@dataclass(frozen=True)
class Record:
    """One run's probe file."""

    world_size: int
    strategy: str
    compute_dtype: str
    params: dict[str, dict[str, Any]]
    """Whole-model parameter name -> {"shape": [...], "dtype": "float32"}."""
    order: list[str]
    """Parameter names in the order the first forward used them (unused ones are not in it)."""
    steps: list[dict[str, Any]]
    """Step 0 (the initial weights), 1, 2, ...: each step's line of the file."""


def read_record(path: Path) -> Record:
    try:
        lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        raise ParityError(f"cannot read the parity record {path}: {e}") from None
    header = next((line for line in lines if line.get("kind") == "run"), None)
    steps = sorted((line for line in lines if line.get("kind") == "step"), key=lambda line: int(line["step"]))
    if header is None or [s["step"] for s in steps] != list(range(len(steps))):
        raise ParityError(f"{path} is not a complete parity record (its run stopped early?)")
    order: list[str] = next((s["order"] for s in steps if "order" in s), [])
    return Record(header["world_size"], header["strategy"], header["compute_dtype"], header["params"], order, steps)


def tolerance_floor(*records: Record) -> tuple[float, str]:
    """The floor for these runs and what it is: FLOOR_UNITS of the least precise dtype any of them computes in
    or keeps a parameter in."""
    dtypes = {r.compute_dtype for r in records} | {p["dtype"] for r in records for p in r.params.values()}
    known = [d for d in dtypes if d in FLOOR_UNITS] or ["float32"]
    coarsest = max(known, key=lambda d: torch.finfo(getattr(torch, d)).eps)
    units = FLOOR_UNITS[coarsest]
    return units * torch.finfo(getattr(torch, coarsest)).eps, f"{units} × eps of {coarsest}"


@dataclass(frozen=True)
class Check:
    """One quantity at one step: A's and B's value, their difference and its tolerance."""

    step: int
    what: str
    """loss | gradient norm | gradient | weight"""
    param: str | None
    checksum: str | None
    """sum | l2 | wsum for a parameter; "replicas" for copies on two ranks of one run; None for a scalar"""
    a: float
    b: float
    difference: float
    tolerance: float
    index: int = -1
    """The parameter's place in execution order (from 0)."""
    spread: float = 0.0
    """The difference between B and B again in this quantity (its tolerance may come from a wider one)."""
    run: str = ""
    """The run whose copies disagree (checksum "replicas"), and the rank holding the odd one."""
    rank: int = -1

    @property
    def exceeds(self) -> bool:
        return self.difference > self.tolerance

    def where(self) -> str:
        if self.checksum == "replicas":
            return f"{self.what} of {self.param}: rank {self.rank}'s copy in {self.run}"
        if self.param is None:
            return self.what
        return f"{self.what} of {self.param} ({self.checksum})"


@dataclass(frozen=True)
class StepRow:
    step: int
    loss: tuple[float | None, float | None]
    grad_norm: tuple[float | None, float | None]
    largest: Check | None
    """The quantity with the largest difference at this step."""
    over: int
    """How many quantities exceed their tolerance."""


@dataclass
class Comparison:
    floor: float
    floor_rule: str
    order: list[str]
    rows: list[StepRow] = field(default_factory=list)
    first: Check | None = None
    """The first quantity over its tolerance (docs/internals.md#appsparitycomparepy)."""
    first_param: Check | None = None
    """The first parameter over its tolerance at that step (None when only the loss or the norm differ)."""
    over_at_first: list[Check] = field(default_factory=list)
    """Every quantity over its tolerance at the first divergent step."""
    widest_spread: Check | None = None
    """The quantity in which B and B again differ most (None: not at all)."""

    @property
    def equal(self) -> bool:
        return self.first is None

    def as_dict(self) -> dict[str, Any]:
        return {
            "equal": self.equal,
            "floor": self.floor,
            "floor_rule": self.floor_rule,
            "spread_factor": SPREAD_FACTOR,
            "execution_order": self.order,
            "steps": [asdict(row) for row in self.rows],
            "first_divergence": asdict(self.first) if self.first else None,
            "first_parameter": asdict(self.first_param) if self.first_param else None,
            "widest_spread": asdict(self.widest_spread) if self.widest_spread else None,
        }


def compare(
    a: Record, b: Record, b_again: Record, floor: float | None = None, labels: tuple[str, str, str] = ("A", "B", "B")
) -> Comparison:
    """A against B, with B against B again as the spread; `floor`: instead of the dtypes' (tolerance_floor)."""
    _check_comparable(a, b, labels)
    _check_comparable(b, b_again, labels[1:])
    rule = tolerance_floor(a, b, b_again)
    result = Comparison(rule[0] if floor is None else floor, rule[1] if floor is None else "given", [])
    result.order = a.order + sorted(set(a.params) - set(a.order))  # unused parameters last
    runs = ((labels[0], a), (labels[1], b), (f"{labels[2]} again", b_again))
    spreads: dict[str, float] = {}  # the widest spread of each kind of quantity so far
    for s, (x, y, z) in enumerate(zip(a.steps, b.steps, b_again.steps, strict=True)):
        checks = _step_checks(s, x, y, z, result.order, result.floor, runs, spreads)
        over = [c for c in checks if c.exceeds]
        largest = max(checks, key=lambda c: c.difference, default=None)
        losses, norms = (x.get("loss"), y.get("loss")), (x.get("grad_norm"), y.get("grad_norm"))
        result.rows.append(StepRow(s, losses, norms, largest, len(over)))
        widest = max(checks, key=lambda c: c.spread, default=None)
        if widest is not None and widest.spread > (result.widest_spread.spread if result.widest_spread else 0.0):
            result.widest_spread = widest
        if over and result.first is None:
            result.first, result.over_at_first = over[0], over
            result.first_param = next((c for c in over if c.param is not None), None)
    return result


def _check_comparable(x: Record, y: Record, labels: tuple[str, ...]) -> None:
    """The same parameters (names and shapes; their dtype may differ: bf16-true against 32-true) and steps."""
    shapes = {n: p["shape"] for n, p in x.params.items()}, {n: p["shape"] for n, p in y.params.items()}
    if shapes[0] != shapes[1]:
        odd = sorted(set(x.params) ^ set(y.params)) or [n for n in x.params if shapes[0][n] != shapes[1][n]]
        raise ParityError(
            f"{labels[0]} and {labels[1]} trained different models (parameters {', '.join(odd[:5])} differ in name "
            "or shape): parity compares one model under two settings."
        )
    if len(x.steps) != len(y.steps):
        raise ParityError(f"{labels[0]} recorded {len(x.steps) - 1} steps and {labels[1]} {len(y.steps) - 1}")


def _step_checks(
    step: int,
    x: dict[str, Any],
    y: dict[str, Any],
    z: dict[str, Any],
    order: list[str],
    floor: float,
    runs: tuple[tuple[str, Record], ...],
    widest: dict[str, float],
) -> list[Check]:
    """Every quantity of one step, in the order the step computes them, each with its tolerance (a parameter's
    checksums as one: the worst). `widest`: the widest spread of each kind of quantity before this step; updated."""
    groups: list[list[Check]] = []

    def scalar(what: str, key: str) -> None:
        if key in x:
            spread, difference = scalar_difference(y[key], z[key]), scalar_difference(x[key], y[key])
            groups.append([Check(step, what, None, None, x[key], y[key], difference, floor, spread=spread)])

    def tensors(what: str, key: str) -> None:
        if key not in x:
            return
        for index, name in enumerate(order):
            groups.append(_param_checks(step, what, name, index, x[key][name], y[key][name], z[key][name], floor))
            for label, run in runs:  # copies on two ranks of one run
                odd = run.steps[step].get("replicas", {}).get(key, {}).get(name)
                if odd is not None:
                    rank, difference = int(odd[0]), float(odd[1])
                    args = (step, what, name, "replicas", 0.0, difference, difference, floor, index)
                    groups.append([Check(*args, run=label, rank=rank)])

    scalar("loss", "loss")
    tensors("gradient", "grads")
    scalar("gradient norm", "grad_norm")
    tensors("weight", "weights")
    for group in groups:
        for c in group:
            if math.isfinite(c.spread):  # B again overflowing where B did not measures nothing: the floor stands
                widest[c.what] = max(widest.get(c.what, 0.0), c.spread)

    # One tolerance per kind of quantity: one for each quantity would be the ratio of two small random differences,
    # and some of thousands would come out above 3 by chance. Copies on two ranks must agree within the floor.
    def tolerated(c: Check) -> Check:
        tolerance = max(SPREAD_FACTOR * widest.get(c.what, 0.0), floor)
        return c if c.checksum == "replicas" else replace(c, tolerance=tolerance)

    return [max((tolerated(c) for c in group), key=_over_by) for group in groups]


def _param_checks(
    step: int, what: str, name: str, index: int, x: Digest | None, y: Digest | None, z: Digest | None, floor: float
) -> list[Check]:
    """One parameter's checks, one per checksum (tolerance: the floor, for now)."""
    if x is None or y is None:  # no gradient (an unused parameter): equal only to no gradient
        differs = math.inf if (x is None) != (y is None) else 0.0
        return [Check(step, what, name, "present", float(x is not None), float(y is not None), differs, floor, index)]
    checks = []
    for checksum, i in COMPARED.items():
        spread = 0.0 if z is None else relative_difference(y, z, i)
        difference = relative_difference(x, y, i)
        checks.append(Check(step, what, name, checksum, x[i], y[i], difference, floor, index, spread=spread))
    return checks


def _over_by(check: Check) -> float:
    """How many tolerances a difference amounts to (a tolerance of 0, given: any difference is infinitely many)."""
    if check.tolerance > 0:
        return check.difference / check.tolerance
    return math.inf if check.difference > 0 else 0.0
