"""The parity check's report: a table of the steps, then the verdict and, when the runs diverged, where first."""

from __future__ import annotations

import math

from trainmesh.apps.parity.compare import SPREAD_FACTOR, Check, Comparison, StepRow


def report_text(comparison: Comparison, a: str, b: str) -> str:
    c = comparison
    lines = [
        a,
        b,
        f"tolerance: max({SPREAD_FACTOR:g} × the spread (B against B again with rounding-sized noise in its "
        f"gradients), floor {c.floor:.1e} ({c.floor_rule})); differences are relative (docs/running.md#parity)",
        "",
        _table(c.rows),
        "",
        _spread(c),
    ]
    if c.equal:
        steps = len(c.rows) - 1
        lines.append(
            f"EQUAL within tolerance: the loss, the gradient norm and the gradients and weights of all "
            f"{len(c.order)} parameters at every step (0-{steps})"
        )
        return "\n".join(lines)
    first = c.first
    assert first is not None
    lines.append(f"DIVERGED at step {first.step}: {_describe(first, len(c.order))}")
    if c.first_param is not None and c.first_param is not first:
        lines.append(f"  first parameter: {_describe(c.first_param, len(c.order))}")
    over = c.over_at_first
    grads = sorted({x.param for x in over if x.what == "gradient" and x.param})
    weights = sorted({x.param for x in over if x.what == "weight" and x.param})
    scalars = [x.what for x in over if x.param is None]
    lines.append(
        f"  at step {first.step} over tolerance: {', '.join(scalars) or 'neither the loss nor the gradient norm'}; "
        f"the gradients of {len(grads)} and the weights of {len(weights)} of {len(c.order)} parameters"
    )
    return "\n".join(lines)


def _spread(c: Comparison) -> str:
    wide = c.widest_spread
    if wide is None:
        return "spread: B again did not move from B (the tolerances are the floor)"
    return f"spread: B again moved from B by up to {wide.spread:.2e} (step {wide.step}, {wide.where()})"


def _describe(check: Check, params: int) -> str:
    if check.checksum == "replicas":
        return (
            f"the {check.what} of {check.param} (parameter {check.index + 1} of {params} in execution order): rank "
            f"{check.rank}'s copy in {check.run} differs from the first holder's by {check.difference:.2e} "
            f"(tolerance {check.tolerance:.1e}); the ranks of one run disagree"
        )
    if check.param is None:
        return (
            f"{check.what} {_number(check.a)} (A) vs {_number(check.b)} (B): relative difference "
            f"{check.difference:.2e}, tolerance {check.tolerance:.1e}"
        )
    if check.checksum == "present":
        has = "A" if check.a else "B"
        return f"the {check.what} of {check.param}: only {has} has one"
    return (
        f"the {check.what} of {check.param} (parameter {check.index + 1} of {params} in execution order): its "
        f"{check.checksum} is {_number(check.a)} (A) vs {_number(check.b)} (B), relative difference "
        f"{check.difference:.2e}, tolerance {check.tolerance:.1e}"
    )


def _table(rows: list[StepRow]) -> str:
    header = ["step", "loss A", "loss B", "grad norm A", "grad norm B", "largest difference", "tolerance", "where"]
    body = []
    for row in rows:
        big = row.largest
        body.append(
            [
                str(row.step),
                *(_number(v) for v in (*row.loss, *row.grad_norm)),
                "-" if big is None else f"{big.difference:.2e}",
                "-" if big is None else f"{big.tolerance:.1e}",
                ("-" if big is None or big.difference == 0 else big.where())
                + (f"  [{row.over} over]" if row.over else ""),
            ]
        )
    widths = [max(len(r[i]) for r in [header, *body]) for i in range(len(header))]
    fmt = [f"{{:>{w}}}" for w in widths[:-1]] + ["{}"]
    return "\n".join(" | ".join(f.format(cell) for f, cell in zip(fmt, r, strict=True)) for r in [header, *body])


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.6g}"
