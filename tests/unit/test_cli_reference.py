"""docs/cli.md, the command reference, is what the parser says today, whatever terminal generates it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from trainmesh.cli.command_reference import render
from trainmesh.cli.flags import build_parser

DOC = Path(__file__).parents[2] / "docs" / "cli.md"


def test_command_reference_is_up_to_date() -> None:
    assert DOC.read_text() == render(), "regenerate: python -m trainmesh.cli.command_reference > docs/cli.md"


def test_the_reference_does_not_depend_on_the_terminal_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = render()
    monkeypatch.setenv("COLUMNS", "40")  # argparse wraps at the terminal's width unless told otherwise
    monkeypatch.setenv("PET_NNODES", "3")  # a launch flag's default comes from PET_<FLAG>
    assert render() == expected


def test_every_command_and_flag_is_in_the_reference() -> None:
    text = render()
    for command in ("run", "check", "bench", "env", "horovodrun", "slurm", "k8s", "plan", "ckpt", "data prepare"):
        assert f"\n## trainmesh {command}\n" in text
    flags = _flags(build_parser())
    assert "--nproc_per_node" in flags and "--parity-rtol" in flags and "--no-progress" in flags
    for flag in flags:
        assert f"`{flag}" in text or f", {flag}" in text, flag
    assert "-np, --num-proc N" in text  # horovodrun's own usage


def _flags(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag of `parser` and of its subcommands, -h/--help aside."""
    found = []
    for action in parser._actions:
        found += [flag for flag in action.option_strings if flag not in ("-h", "--help")]
        if isinstance(action, argparse._SubParsersAction):
            found += [flag for sub in action.choices.values() for flag in _flags(sub)]
    return found
