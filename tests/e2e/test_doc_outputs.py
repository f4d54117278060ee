"""The sample outputs in the docs are what the commands print today, so that they cannot drift.

Every fenced block of README.md and docs/*.md is read for lines `$ trainmesh ...` (or `$ .venv/bin/trainmesh ...`,
a trailing backslash continuing the command); the lines after one, up to the next `$ ` line or the block's end, are
its documented output. The cheap and deterministic commands, `check` (without --parity) and `plan` (without
--calibrate or --cluster this), are run here, in this process, from the repository's root, and must print exactly
those lines (stdout and the log, in order), with one normalisation on both sides: a log line's time
(`05:28:10 ERROR ...`) reads `HH:MM:SS`. The other commands train (`run`, `bench`, `check --parity`) or measure
this machine: their outputs are examples, not checked.

`check`'s memory line compares the prediction with the memory of the machine it runs on, so the commands run on the
machine the docs describe (`documented_machine`: no GPU, 23.5 GiB of host memory: the 2-core development box of
BENCHMARKS.md), wherever the test runs.

When a block differs and the new output is intended, rewrite the docs' outputs with today's:

    OMP_NUM_THREADS=1 .venv/bin/python tests/e2e/test_doc_outputs.py --update

and review `git diff README.md docs/`.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest

from trainmesh.apps.plan.cluster import GiB
from trainmesh.cli import main

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS = ("trainmesh", ".venv/bin/trainmesh")
DOCUMENTED_MEMORY = 23.5 * GiB
"""The host memory of the machine the docs' outputs come from (see the module docstring)."""
UPDATE = "OMP_NUM_THREADS=1 .venv/bin/python tests/e2e/test_doc_outputs.py --update"
TIME = re.compile(r"^\d\d:\d\d:\d\d ")


@dataclass(frozen=True)
class Sample:
    """A documented command and the lines shown as its output."""

    doc: Path
    line: int
    """The 1-based line of the `$ ` command in `doc`."""
    argv: list[str]
    """The arguments after the program's name."""
    first: int
    """The 0-based index in `doc` of the first output line; the output ends before `end`."""
    end: int
    output: list[str]

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def documented_samples(doc: Path) -> list[Sample]:
    """Every cheap, deterministic command in `doc`'s fenced blocks with its documented output."""
    lines = doc.read_text(encoding="utf-8").splitlines()
    found: list[Sample] = []
    in_block, i = False, 0
    while i < len(lines):
        if lines[i].startswith("```"):
            in_block = not in_block
        elif in_block and lines[i].startswith("$ "):
            start, command = i, lines[i][2:]
            while command.endswith("\\") and i + 1 < len(lines):
                i += 1
                command = command[:-1] + " " + lines[i].strip()
            end = i + 1
            while end < len(lines) and not lines[end].startswith(("$ ", "```")):
                end += 1
            words = shlex.split(command)
            if words[0] in PROGRAMS and _cheap(words[1:]):
                found.append(Sample(doc, start + 1, words[1:], i + 1, end, lines[i + 1 : end]))
            i = end
            continue
        i += 1
    return found


def _cheap(args: list[str]) -> bool:
    """Runs in seconds and prints the same everywhere: check without --parity, plan without measuring."""
    if args[0] == "check":
        return not any(a.startswith("--parity") for a in args)
    if args[0] == "plan":
        return "--calibrate" not in args and "this" not in args
    return False


def all_samples() -> list[Sample]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [sample for doc in docs for sample in documented_samples(doc)]


@contextlib.contextmanager
def documented_machine() -> Iterator[None]:
    """This process seen as the docs' machine by `check`'s memory line: no GPU, DOCUMENTED_MEMORY of host memory."""
    with (
        mock.patch("trainmesh.apps.plan.check.host_memory", return_value=DOCUMENTED_MEMORY),
        mock.patch("torch.cuda.is_available", return_value=False),
    ):
        yield


def printed(argv: list[str]) -> list[str]:
    """The lines `trainmesh <argv>` prints (stdout and the log, in order), run from the repository's root on the
    documented machine."""
    out = io.StringIO()
    with (
        contextlib.chdir(ROOT),  # the docs' paths are relative to the root
        documented_machine(),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(out),
        contextlib.suppress(SystemExit),  # argparse's refusal: its message is the output
    ):
        main(argv)
    return out.getvalue().splitlines()


def normalised(lines: list[str]) -> list[str]:
    return [TIME.sub("HH:MM:SS ", line.rstrip()) for line in lines]


def _params() -> list[object]:
    return [pytest.param(sample, id=sample.where) for sample in all_samples()]


@pytest.mark.parametrize("sample", _params())
def test_a_documented_output_is_what_the_command_prints(sample: Sample) -> None:
    got, shown = normalised(printed(sample.argv)), normalised(sample.output)
    if got != shown:
        diff = "\n".join(difflib.unified_diff(shown, got, "documented", "printed today", lineterm=""))
        pytest.fail(
            f"{sample.where}: the output shown for `trainmesh {shlex.join(sample.argv)}` is not what it prints "
            f"today:\n{diff}\nIf the new output is right, update the docs with `{UPDATE}` (it rewrites every "
            "documented output that differs) and review the diff; else fix the command.",
            pytrace=False,
        )


def test_the_documented_commands_are_found() -> None:
    """The parser finds the blocks this test exists for (a change of their format would otherwise check nothing)."""
    found = {(s.where.split(":")[0], s.argv[0]) for s in all_samples()}
    assert {("docs/running.md", "check"), ("docs/plan.md", "plan"), ("docs/parallelism.md", "check")} <= found
    assert all(s.output for s in all_samples()), "a documented command without its output"


def update_docs(only: list[Path]) -> None:
    """Rewrite each documented output that differs with what the command prints today (`only`: in these files)."""
    by_doc: dict[Path, list[Sample]] = {}
    for sample in all_samples():
        if not only or sample.doc in only:
            by_doc.setdefault(sample.doc, []).append(sample)
    for doc, samples in by_doc.items():
        lines = doc.read_text(encoding="utf-8").splitlines()
        changed = False
        for sample in reversed(samples):  # from the end: the earlier blocks' line numbers stay valid
            got = printed(sample.argv)
            if normalised(got) != normalised(sample.output):
                lines[sample.first : sample.end] = got
                changed = True
                print(f"updated {sample.where}: trainmesh {shlex.join(sample.argv)}")
        if changed:
            doc.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Rewrite the docs' sample outputs with today's (see the docstring).")
    parser.add_argument("--update", action="store_true", help="rewrite the outputs that differ")
    parser.add_argument("docs", nargs="*", type=Path, help="only in these files (default: README.md and docs/*.md)")
    args = parser.parse_args()
    if not args.update:
        parser.print_help()
        sys.exit(2)
    update_docs([doc.resolve() for doc in args.docs])
