"""`trainmesh check <recipe> --config F --parity [--parity-steps K] [--parity-a '...'] [--parity-b '...']`: train
A, B and B again for K steps, each a run of its own, and compare them step by step against the spread of B and B
again.

Details: docs/internals.md#cliparitypy
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import math
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainmesh.apps.parity.compare import Comparison, ParityError, compare, read_record
from trainmesh.apps.parity.report import report_text
from trainmesh.config import Config, ConfigError
from trainmesh.config.loader import config_to_dict
from trainmesh.core.env import vars_set
from trainmesh.core.errors import UserError
from trainmesh.core.files import write_atomically
from trainmesh.core.logging import get_logger
from trainmesh.job.launcher import check_launch, launch_into, launch_options
from trainmesh.job.rundir import RunFolder
from trainmesh.job.spec import Job, load_config, resolve
from trainmesh.launch import LaunchOptions
from trainmesh.train.parity import ENV_VAR, NUDGE_VAR

log = get_logger(__name__)

PARITY_JSON = "parity.json"
RECORD_FILE = "parity-record.jsonl"
DEFAULT_STEPS = 5


def parity_overrides(steps: int) -> list[str]:
    """What every side of a parity check runs: `steps` steps, a record per step, nothing else between them (and
    no experiment tracker: a check is not an experiment)."""
    return [
        f"--train.max_steps={steps}",
        "--train.eval_every=0",
        "--checkpoint.every=0",
        "--checkpoint.final=false",
        "--checkpoint.resume=false",
        "--sample.max_new_tokens=0",
        "--run.log_every=1",
        "--run.progress=false",
        "--profile.enabled=false",
        '--log.sinks=["tensorboard"]',
    ]


SET_BY_PARITY = {o.removeprefix("--").split("=")[0] for o in parity_overrides(1)} | {"run.id", "run.out_dir"}
SAME_ON_BOTH_SIDES = ("model", "data", "run.seed")
"""What makes the initial weights and the data order: a side that changes it compares two other trainings."""


@dataclass(frozen=True)
class Side:
    name: str
    """Its run folder's name in the parity folder."""
    label: str
    job: Job
    overrides: list[str]
    """The side's own overrides (besides the common ones)."""

    @property
    def nproc(self) -> int:
        return self.job.world_size

    def describe(self) -> str:
        strategy, dims = self.job.layout
        return f"{self.label}: {self.nproc} process(es), {strategy} on {dims.describe()}, {self.job.batch.describe()}"


def check_parity_flags(args: argparse.Namespace) -> None:
    """Parity flags without --parity, or with flags they cannot go with (before anything else)."""
    values = {"--parity-steps": args.parity_steps, "--parity-a": args.parity_a, "--parity-b": args.parity_b}
    given = [flag for flag, value in {**values, "--parity-rtol": args.parity_rtol}.items() if value is not None]
    if not args.parity:
        if given:
            raise ParityError(f"{', '.join(given)}: only with --parity (the parity check). Fix: add --parity.")
        return
    if args.resume:
        raise ParityError("--resume cannot go with --parity: each side of a parity check starts from step 0")
    if args.parity_steps is not None and args.parity_steps < 1:
        raise ParityError(f"--parity-steps={args.parity_steps}: must be at least 1")
    if args.parity_rtol is not None and not (math.isfinite(args.parity_rtol) and args.parity_rtol >= 0):
        raise ParityError(f"--parity-rtol={args.parity_rtol}: a relative tolerance is 0 or more (e.g. 1e-5)")


def side_overrides(flag: str, text: str | None) -> list[str]:
    """--parity-a/-b's value: `section.key=value` items separated by spaces (a leading -- is optional)."""
    try:
        items = [] if text is None else shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise ParityError(
            f"{flag}={text!r} cannot be split into overrides ({e}). Fix: close the quote, e.g. "
            f"{flag}='optim.lr=0.1 parallel.strategy=fsdp'."
        ) from None
    overrides = []
    for item in items:
        key, sep, _ = item.removeprefix("--").partition("=")
        if not sep or "." not in key:
            raise ParityError(
                f"{flag}={text!r}: {item!r} is not an override. Fix: {flag}='section.key=value ...', e.g. "
                f"{flag}='parallel.strategy=fsdp'."
            )
        overrides.append("--" + item.removeprefix("--"))
    _check_not_set_by_parity(flag, overrides)
    return overrides


def _check_not_set_by_parity(
    where: str, overrides: list[str], allowed: frozenset[str] | set[str] = frozenset()
) -> None:
    """Refuse an override of what every side runs with (it would be silently replaced)."""
    for item in overrides:
        key = item.removeprefix("--").partition("=")[0]
        if key in SET_BY_PARITY - allowed:
            raise ParityError(
                f"{where}: the parity check sets {key} itself (the same on both sides; --parity-steps sets the "
                f"steps). Fix: leave {key} out of {where}."
            )


def plan_sides(args: argparse.Namespace, overrides: list[str], opts: LaunchOptions) -> tuple[Side, Side]:
    """A and B, resolved and checked (exit 2 on any problem, before anything is written)."""
    if opts.multi_node:
        raise ParityError(f"--nnodes={opts.nnodes}: the parity check runs on one node. Fix: --nnodes 1.")
    opts.check()
    steps = args.parity_steps or DEFAULT_STEPS
    forced = parity_overrides(steps)
    _check_not_set_by_parity("the common overrides (after --)", overrides, allowed=frozenset({"run.id", "run.out_dir"}))
    common = load_config(args.config, [*overrides, *forced], args.target)  # errors in the config or common overrides
    check_launch(common, opts)
    n = opts.nproc()
    a_own, b_own = side_overrides("--parity-a", args.parity_a), side_overrides("--parity-b", args.parity_b)
    if args.parity_a is None and args.parity_b is None:
        if n < 2:
            raise ParityError(
                f"--parity compares the launch's processes with one process, but --nproc-per-node={opts.nproc_per_node}"
                " is one. Fix: --nproc-per-node 2 (or more), or compare two settings with --parity-a/--parity-b."
            )
        b = _side("candidate", f"B ({n} processes)", args, overrides, [], forced, n, "")
        # The same global batch on one process (more accumulation steps), no model parallelism.
        single = [
            f"--train.global_batch={b.job.batch.global_batch}",
            "--train.global_batch_tokens=0",
            *(f"--parallel.{k}=1" for k in ("pp", "tp", "dp_replicate")),
            "--parallel.dp_shard=-1",
            "--parallel.strategy=auto",
        ]
        a = _side("reference", "A (1 process)", args, overrides, single, forced, 1, "")
    else:
        a = _side("reference", _label("A", a_own), args, overrides, a_own, forced, n, "--parity-a")
        b = _side("candidate", _label("B", b_own), args, overrides, b_own, forced, n, "--parity-b")
    _check_comparable(a, b)
    return a, b


def _label(side: str, own: list[str]) -> str:
    return f"{side} ({' '.join(own) if own else 'no overrides of its own'})"


def _side(
    name: str,
    label: str,
    args: argparse.Namespace,
    common: list[str],
    own: list[str],
    forced: list[str],
    world: int,
    flag: str,
) -> Side:
    try:
        config = load_config(args.config, [*common, *own, *forced], args.target)
        job = resolve(config, world)
    except ConfigError as e:
        where = f"{flag}" if flag else f"the {world}-process side"
        raise ParityError(f"{where}: {e}") from None
    return Side(name, label, job, own)


def _check_comparable(a: Side, b: Side) -> None:
    if a.job.batch.global_batch != b.job.batch.global_batch:
        raise ParityError(
            f"the sides train on different global batches ({a.label}: {a.job.batch.global_batch} samples per step, "
            f"{b.label}: {b.job.batch.global_batch}), so their steps differ. Fix: --train.global_batch=N in the "
            "common overrides (after --)."
        )
    ours, theirs = _flat(config_to_dict(a.job.config)), _flat(config_to_dict(b.job.config))
    changed = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    same = [k for k in changed if any(k == p or k.startswith(p + ".") for p in SAME_ON_BOTH_SIDES)]
    if same:
        raise ParityError(
            f"the sides differ in {', '.join(same)}: the initial weights or the data order would differ, and so would "
            "any two trainings. Fix: set these in the common overrides (after --), not in --parity-a/-b."
        )
    dropout = float(getattr(a.job.config.model, "dropout", 0.0) or 0.0)
    layout_a, layout_b = (a.job.batch.dp_size, a.job.batch.accum_steps), (b.job.batch.dp_size, b.job.batch.accum_steps)
    if dropout > 0 and layout_a != layout_b:
        raise ParityError(
            f"model.dropout={dropout}: each rank draws its own dropout masks, so {a.label} and {b.label}, which deal "
            "the micro-batches to different ranks, drop different units of the same sample. Fix: --model.dropout=0."
        )


def _flat(table: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        flat.update(_flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
    return flat


def cmd_parity(args: argparse.Namespace, overrides: list[str]) -> int:
    """The parity check (docs/internals.md#cliparitypy); 0 equal, 1 diverged, 2 bad input, else a failed run's code."""
    check_parity_flags(args)
    opts = dataclasses.replace(launch_options(args), max_restarts=0)  # a restarted side would start its record over
    a, b = plan_sides(args, overrides, opts)
    folder = _claim_folder(a.job.config)  # everything is checked: from here on the check writes
    parity_dir = folder.path
    runs = [(a, a.name), (b, b.name), (b, f"{b.name}-again")]
    steps = a.job.config.train.max_steps
    log.info(
        "parity folder: %s; %d steps of\n  %s\n  %s (and again, nudged)", parity_dir, steps, a.describe(), b.describe()
    )
    with folder:
        for side, name in runs:
            log.info("parity run %s: %s", name, side.describe())
            code = _launch(opts, side, parity_dir, name, f"{folder.job_id}-{name}", nudge=name.endswith("-again"))
            if code != 0:
                log.error("parity run %s failed with exit code %d; its run folder: %s", name, code, parity_dir / name)
                return code
        ref, cand, again = (read_record(parity_dir / name / RECORD_FILE) for _, name in runs)
        comparison = compare(ref, cand, again, floor=args.parity_rtol)
        _write_json(parity_dir, args, a, b, comparison)
    print(report_text(comparison, a.describe(), b.describe()))
    print(f"parity folder: {parity_dir} ({PARITY_JSON}; the runs: {', '.join(name for _, name in runs)})")
    return 0 if comparison.equal else 1


def _claim_folder(config: Config) -> RunFolder:
    out_dir, name = Path(config.run.out_dir), config.run.id
    if not name:
        return RunFolder.new(out_dir, f"{config.run.recipe}-parity")
    if (out_dir / name).exists():
        raise ParityError(
            f"--run-id {name}: {out_dir / name} already exists, and a parity check writes new run folders. Fix: "
            "another --run-id, or leave it out for a new <recipe>-parity-<date>-<time> folder."
        )
    return RunFolder.named(out_dir, name)


def _launch(opts: LaunchOptions, side: Side, parity_dir: Path, name: str, launch_id: str, nudge: bool) -> int:
    run = dataclasses.replace(side.job.config.run, out_dir=str(parity_dir))
    job = dataclasses.replace(side.job, config=dataclasses.replace(side.job.config, run=run)).named(name, resume=False)
    folder = RunFolder.named(parity_dir, name, launch_id)
    with _probe_on(folder.path / RECORD_FILE, nudge):
        try:
            side_opts = dataclasses.replace(opts, nproc_per_node=str(side.nproc))
            return launch_into(side_opts, [job], job, folder)
        except UserError as e:  # e.g. a port in use
            log.error("%s", e)
            return 2


@contextlib.contextmanager
def _probe_on(record: Path, nudge: bool) -> Iterator[None]:
    """The environment the side's workers inherit: the probe's file, whether to nudge the gradients (B again), and
    one thread per rank unless set (the same kernels, so the same order of floating-point sums, in every run)."""
    values = {ENV_VAR: str(record.resolve()), NUDGE_VAR: "1" if nudge else "0"}
    with vars_set(values, defaults={"OMP_NUM_THREADS": "1"}):
        yield


def _write_json(parity_dir: Path, args: argparse.Namespace, a: Side, b: Side, comparison: Comparison) -> None:
    command = shlex.join(getattr(args, "command_line", None) or ["trainmesh", "check", args.target, "--parity"])
    sides = {
        side.name: {"label": side.label, "describe": side.describe(), "overrides": side.overrides, "nproc": side.nproc}
        for side in (a, b)
    }
    document = {
        "command": command,
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "recipe": a.job.config.run.recipe,
        "sides": sides,
        "runs": {"A": "reference", "B": "candidate", "B again": "candidate-again"},
        "tolerance": "max(spread_factor × the widest |B − B again| of the quantity's kind and checksum at its step, "
        "floor); relative differences (see trainmesh.apps.parity.compare)",
        **comparison.as_dict(),
    }
    write_atomically(parity_dir / PARITY_JSON, json.dumps(document, indent=2, default=str) + "\n")
