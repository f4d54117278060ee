"""The command line's parser: instant (no torch import), --version, and the recipe names it lists."""

from __future__ import annotations

import subprocess
import sys

import pytest

from trainmesh.cli import RECIPE_NAMES, main
from trainmesh.recipes import RECIPES


def test_help_and_version_import_no_torch() -> None:
    """`trainmesh --help` in well under a second: the parser must not pull in torch (1.5 s here)."""
    probe = "import sys, trainmesh.cli; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], check=False).returncode == 0


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("trainmesh ")


def test_the_parser_lists_every_built_in_recipe() -> None:
    assert set(RECIPE_NAMES) == set(RECIPES)
