"""Horovod's own PyTorch tests against trainmesh.horovod (docs/horovod.md, "Horovod's own tests"): the yardstick of
issue 29, not part of `make test`. The file runs on 2 CPU ranks as Horovod's Gloo runner runs it (HOROVOD_RANK and
the rest set on each rank, so each test's tearDown shuts Horovod down and the next one init()s again), with
`import horovod.torch` answered by this package's shim:

    git clone https://github.com/horovod/horovod /tmp/horovod      # the counts in the docs: commit 2626dc87
    pip install mock cloudpickle                                    # Horovod's test helpers import them
    python benchmarks/horovod_upstream.py /tmp/horovod [--each] [--only REGEX] [--without-muon] [--json out.json]

By default the whole file runs in one process pair (`pytest test_torch.py` on each rank, as Horovod's CI does with
horovodrun --gloo); `--each` runs every test in its own pair instead, each with a time limit (a hang is counted, not
waited for). Prints the counts and every test that did not pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from xml.etree import ElementTree

import psutil

RANK_MAIN = """\
import os, sys
import pytest
# what horovodrun --gloo sets on each process, from torchrun's variables
for ours, theirs in [("RANK", "RANK"), ("WORLD_SIZE", "SIZE"), ("LOCAL_RANK", "LOCAL_RANK"),
                     ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"), ("GROUP_RANK", "CROSS_RANK")]:
    os.environ["HOROVOD_" + theirs] = os.environ[ours]
os.environ["HOROVOD_CROSS_SIZE"] = "1"
if os.environ.get("HOROVOD_UPSTREAM_WITHOUT_MUON") == "1":
    import torch
    def subclasses(cls):
        found = type.__subclasses__(cls)
        return [c for c in found if c.__name__ != "Muon"] if cls is torch.optim.Optimizer else found
    torch.optim.Optimizer.__subclasses__ = classmethod(subclasses)
junit = os.path.join(sys.argv[1], "rank%s.xml" % os.environ["RANK"])
log = open(os.path.join(sys.argv[1], "rank%s.log" % os.environ["RANK"]), "w")  # each rank's own output
os.dup2(log.fileno(), 1)
os.dup2(log.fileno(), 2)
os.chdir(sys.argv[2])
sys.exit(pytest.main(["-v", "-p", "no:cacheprovider", "-o", "addopts=", "--junit-xml", junit, *sys.argv[3:]]))
"""
ALIAS = "import sys\nimport trainmesh.horovod as _shim\n\nsys.modules[__name__] = _shim\n"
RANKING = ["FAILED", "PASSED", "SKIPPED"]
"""A test's outcome over the two ranks, when both finished it: failed on either, else passed on either, else
skipped."""
VERBOSE = re.compile(r"::(test_\w+) (PASSED|FAILED|SKIPPED|ERROR)")
"""pytest -v's line for a test: what a pair that hung (no report written) had finished."""


def harness(horovod: Path) -> Path:
    """A folder with a `horovod` package whose `horovod.torch` is the shim, and the one module of Horovod's own that
    its test helpers import (horovod.runner.util.threads, pure Python)."""
    root = Path(tempfile.mkdtemp(prefix="horovod_upstream_"))
    (root / "horovod" / "torch").mkdir(parents=True)
    (root / "horovod" / "runner" / "util").mkdir(parents=True)
    for package in ("horovod", "horovod/runner", "horovod/runner/util"):
        (root / package / "__init__.py").write_text("")
    (root / "horovod" / "torch" / "__init__.py").write_text(ALIAS)
    shutil.copy(horovod / "horovod" / "runner" / "util" / "threads.py", root / "horovod" / "runner" / "util")
    (root / "rank_main.py").write_text(RANK_MAIN)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_pair(
    root: Path, tests: Path, selection: list[str], timeout: float, log: Path | None
) -> tuple[dict[str, str], bool]:
    """2 ranks under torchrun running pytest on `selection`: each test's outcome over the two ranks (RANKING), and
    whether the time limit ended the pair; `log`: where to write their output."""
    src = Path(__file__).resolve().parents[1] / "src"
    path = os.pathsep.join(filter(None, [str(src), str(root), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    reports = Path(tempfile.mkdtemp(dir=root))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port"]
    command += [str(free_port()), str(root / "rank_main.py"), str(reports), str(tests), *selection]
    with open(reports / "torchrun.log", "w") as torchrun:
        launcher = subprocess.Popen(command, env=env, stdout=torchrun, stderr=subprocess.STDOUT)
        try:
            launcher.wait(timeout=timeout)
            hung = False
        except subprocess.TimeoutExpired:
            _end(launcher.pid)
            launcher.wait()
            hung = True
    logs = [reports / f"rank{r}.log" for r in range(2)]
    if log is not None:
        parts = {"torchrun": reports / "torchrun.log", "rank 0": logs[0], "rank 1": logs[1]}
        log.write_text("".join(f"== {k} ==\n{p.read_text() if p.exists() else ''}\n" for k, p in parts.items()))
    ranks = [_reported(reports / f"rank{r}.xml", logs[r]) for r in range(2)]
    found = {}
    for test in set(ranks[0]) | set(ranks[1]):
        outcomes = [r.get(test, "") for r in ranks]
        if "FAILED" in outcomes:
            found[test] = "FAILED"
        elif "" not in outcomes:  # a rank that never finished it: hung, or crashed (the caller counts it)
            found[test] = min(outcomes, key=RANKING.index)
    return found, hung


def _end(pid: int) -> None:
    """Kill torchrun and its workers (each runs in a session of its own, so killing torchrun leaves them)."""
    with contextlib.suppress(psutil.NoSuchProcess):
        launcher = psutil.Process(pid)
        for process in [*launcher.children(recursive=True), launcher]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()


def _reported(report: Path, log: Path) -> dict[str, str]:
    """One rank's outcome of each test it finished: from its JUnit report, or when it was stopped before writing one,
    from its pytest -v lines."""
    if report.exists():
        found = {}
        for case in ElementTree.parse(report).iter("testcase"):
            kinds = {child.tag for child in case}
            outcome = "FAILED" if kinds & {"failure", "error"} else "SKIPPED" if "skipped" in kinds else "PASSED"
            found[case.get("name", "")] = outcome
        return found
    lines = VERBOSE.findall(log.read_text()) if log.exists() else []
    return {test: "FAILED" if outcome == "ERROR" else outcome for test, outcome in lines}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("horovod", type=Path, help="a checkout of github.com/horovod/horovod")
    parser.add_argument("--each", action="store_true", help="every test in its own process pair")
    parser.add_argument("--only", default="", help="the tests whose names match this regular expression")
    parser.add_argument("--timeout", type=float, default=90, help="seconds per test with --each (default 90)")
    parser.add_argument("--json", type=Path, help="write each test's outcome here")
    parser.add_argument("--logs", type=Path, help="a folder for the ranks' output (one file per pair)")
    parser.add_argument(
        "--without-muon",
        action="store_true",
        help="leave torch.optim.Muon (torch >= 2.9, 2D parameters only) out of the optimizers 3 tests enumerate, as "
        "they leave out LBFGS and SparseAdam: the file predates it, and its test model has 1D parameters",
    )
    args = parser.parse_args()
    tests = args.horovod / "test" / "parallel"
    if not (tests / "test_torch.py").is_file():
        sys.exit(f"{args.horovod}: no test/parallel/test_torch.py there; give a checkout of horovod/horovod")
    names = re.findall(r"^    def (test_\w+)", (tests / "test_torch.py").read_text(), re.M)
    names = [n for n in names if re.search(args.only, n)]
    if not names:
        sys.exit(f"--only {args.only!r}: no test of test_torch.py matches it")
    root = harness(args.horovod)
    os.environ["HOROVOD_UPSTREAM_WITHOUT_MUON"] = "1" if args.without_muon else "0"
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, str] = {}
    try:
        if args.each:
            for name in names:
                log = args.logs / f"{name}.log" if args.logs else None
                found, hung = run_pair(root, tests, [f"test_torch.py::TorchTests::{name}"], args.timeout, log)
                results[name] = "HUNG" if hung else found.get(name, "FAILED")
                print(f"{results[name]:8} {name}", flush=True)
        else:
            selection = [f"test_torch.py::TorchTests::{n}" for n in names] if args.only else ["test_torch.py"]
            log = args.logs / "pair.log" if args.logs else None
            found, hung = run_pair(root, tests, selection, 60.0 * len(names), log)
            results = {n: found.get(n, "HUNG" if hung else "FAILED") for n in names}
    finally:
        shutil.rmtree(root)
    counts = {k: sum(v == k for v in results.values()) for k in ("PASSED", "FAILED", "HUNG", "SKIPPED")}
    print(f"{len(results)} tests, {'each in its own pair' if args.each else 'as one pair'}: {counts}")
    for name, outcome in results.items():
        if outcome in ("FAILED", "HUNG"):
            print(f"  {outcome}: {name}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
