"""trainmesh's default paths never import torchao: every module of the package, and a training step of the default
precision, in a fresh process. torchao loads its C++ extensions when imported and logs `Failed to load ..._C_*.so`
for any built for another Python or torch; only `train.precision = "fp8-mixed"` needs it (precision/fp8.py imports
it there, and says what it needs when torchao is missing or broken). transformers' model classes import torchao
themselves when it is installed: not trainmesh's to change, and no module of trainmesh imports transformers."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from support import nano_toml
from trainmesh.precision.fp8 import torchao_problem

PROBE = """
import importlib, json, pkgutil, sys
import trainmesh

for info in pkgutil.walk_packages(trainmesh.__path__, "trainmesh."):
    if info.name.endswith("__main__"):  # runs a command when imported
        continue
    try:
        importlib.import_module(info.name)
    except ModuleNotFoundError as e:  # an optional package that is not installed (ray): its module is not default
        if (e.name or "").startswith("trainmesh"):
            raise
from trainmesh.job.worker import main

code = main(sys.argv[1:])  # one process, as under plain python: the default run path
loaded = sorted({name.split(".")[0] for name in sys.modules} & {"torchao", "transformers"})
print(json.dumps({"code": code, "loaded": loaded, "fp8": "trainmesh.precision.fp8" in sys.modules}))
"""


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed: nothing to import")
@pytest.mark.timeout(120)
def test_no_default_path_imports_torchao(tmp_path: Path) -> None:
    args = ["gpt", "--config", str(nano_toml(tmp_path)), "--run-dir", str(tmp_path / "run"), "--train.max_steps=1"]
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"code": 0, "loaded": [], "fp8": True}, result.stderr[-3000:]
    assert "Failed to load" not in result.stderr


def test_fp8_mixed_says_what_it_needs_when_torchao_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if not installed: the import raises at once
    problem = str(torchao_problem("fp8-mixed"))
    assert "needs torchao (its float8 training: torchao>=0.10" in problem and "is not installed here" in problem
    assert "Fix: pip install 'trainmesh[fp8]', or --train.precision=bf16-mixed." in problem


def test_fp8_mixed_says_what_it_needs_when_torchao_is_broken(monkeypatch: pytest.MonkeyPatch) -> None:
    """Installed, but its float8 API does not import: a release for another torch, or without these names."""
    monkeypatch.setitem(sys.modules, "torchao.float8", types.ModuleType("torchao.float8"))
    problem = str(torchao_problem("fp8-mixed"))
    assert "needs torchao's float8 training (Float8LinearConfig, convert_to_float8_training), but torchao" in problem
    assert f"fails to import it with torch {torch.__version__} here (ImportError: cannot import name" in problem
    assert "Fix: install a torchao release built for this torch" in problem
