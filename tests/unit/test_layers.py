"""The layers of trainmesh (docs/concepts.md): imports point down only, so no two packages import each other; and
the process environment is read in core/env.py only.

Every `trainmesh` import in the source counts, lazy ones inside functions too; only imports under
`if TYPE_CHECKING:` (annotations, never run) are left out.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).parents[2] / "src" / "trainmesh"

# Bottom to top. A package may import packages of lower layers only (and itself).
LAYERS: list[set[str]] = [
    {"core"},  # environment, process group plumbing, logging, exit codes, files, batch math: imports nothing
    {"config"},  # pure data: the option dataclasses and the names they may take
    {"precision", "data", "layers", "metrics", "launch"},  # launch: torchrun's agent, rank logs, the N-rank spawner
    {"strategies"},
    {"runtime", "checkpoint"},
    {"recipes"},
    {"train"},
    {"job"},  # resolve -> Job, the run folder's life, the launcher side of run/check, the per-rank worker
    {"apps", "compat"},  # products on the engine (plan, bench, parity, job files); Horovod's API, Ray Train
    {"cli", "__main__"},
]
FACADE = "__init__"  # trainmesh/__init__.py names the public API lazily; nothing imports it but the CLI (--version)


def _unit(path: Path) -> str:
    """The layer unit of a source file: its sub-package, or the module itself at the top level."""
    rel = path.relative_to(SRC)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, imported unit) of every trainmesh import in `path` outside `if TYPE_CHECKING:` blocks."""
    tree = ast.parse(path.read_text(), str(path))
    type_only = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for node in ast.walk(block)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
        for name in names:
            parts = name.split(".")
            if parts[0] == "trainmesh":
                found.append((node.lineno, parts[1] if len(parts) > 1 else FACADE))
    return found


def _layer_of() -> dict[str, int]:
    return {unit: i for i, layer in enumerate(LAYERS) for unit in layer}


def test_every_package_has_a_layer() -> None:
    units = {_unit(p) for p in SRC.rglob("*.py")} - {FACADE}
    assert units == set(_layer_of()), "add the new package to LAYERS (and docs/concepts.md), or drop the old one"


def test_imports_point_down_only() -> None:
    layer = _layer_of()
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        here = _unit(path)
        for line, there in _imports(path):
            if there == here or (there == FACADE and here == "cli"):
                continue
            if there != FACADE and there not in layer:
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {here} imports trainmesh.{there}, no package")
            elif there == FACADE or layer[there] >= layer[here]:
                upward.append(f"{path.relative_to(SRC.parent)}:{line}: {here} imports {there}")
    assert not upward, "imports that point up or sideways (a cycle waiting to happen):\n" + "\n".join(upward)


def test_the_check_catches_a_cycle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above must fail on the cycles this project once had, e.g. runtime <-> strategies."""
    sources = {"runtime": "from trainmesh.strategies import Strategy\n", "strategies": "import trainmesh.runtime\n"}
    for unit, text in sources.items():
        (tmp_path / unit).mkdir()
        (tmp_path / unit / "m.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    with pytest.raises(AssertionError, match="strategies imports runtime"):
        test_imports_point_down_only()
    (tmp_path / "strategies" / "m.py").write_text("if TYPE_CHECKING:\n    import trainmesh.runtime\n")
    test_imports_point_down_only()  # annotations only: allowed


ENVIRONMENT_READERS = {"core/env.py", "launch/spawn.py"}  # spawn.py: a forked test rank's whole environment
_ENV_NAMES = {"environ", "environb", "getenv", "putenv", "unsetenv"}


def _environment_uses(path: Path) -> list[int]:
    """Lines of `path` that touch the process environment directly (os.environ, os.getenv, ...)."""
    tree = ast.parse(path.read_text(), str(path))
    names_of_os = {"os"} | {
        a.asname for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names if a.name == "os"
    }
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _ENV_NAMES:
            if isinstance(node.value, ast.Name) and node.value.id in names_of_os:
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in _ENV_NAMES]
    return lines


def test_the_environment_is_read_in_one_place() -> None:
    """Every variable trainmesh reads goes through core/env.py (read_var, var_is_set, vars_set, ...)."""
    found = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(SRC.rglob("*.py"))
        if path.relative_to(SRC).as_posix() not in ENVIRONMENT_READERS
        for line in _environment_uses(path)
    ]
    assert not found, "read the environment through trainmesh.core.env instead:\n" + "\n".join(found)


def test_the_environment_check_catches_a_direct_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "m.py").write_text("import os\nx = os.environ.get('RANK')\n")
    (tmp_path / "train" / "n.py").write_text("from os import getenv\n")
    (tmp_path / "train" / "o.py").write_text("import os as system\n\nsystem.environ['RANK'] = '0'\n")
    monkeypatch.setattr(sys.modules[__name__], "SRC", tmp_path)
    with pytest.raises(AssertionError, match=r"train/m.py:2\n\s*train/n.py:1\n\s*train/o.py:3"):
        test_the_environment_is_read_in_one_place()
