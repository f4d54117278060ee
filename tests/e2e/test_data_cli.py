"""`trainmesh data prepare` on the real command line: a corpus prepared, then trained on by the GPT recipe; bad
inputs end with exit code 2 and a message that says what to fix; a damaged shard stops training naming it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support import nano_toml
from trainmesh.cli import main

pytestmark = pytest.mark.slow

SRC = Path(__file__).resolve().parents[2] / "src"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
}


def _trainmesh(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainmesh.cli", *args]
    return subprocess.run(command, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=180, check=False)


def _train(cwd: Path, data: Path, *overrides: str) -> subprocess.CompletedProcess[str]:
    """One process of `python -m trainmesh gpt`, the nano model, on the prepared folder (model.vocab_size=0: from
    the data, instead of the byte tokenizer's 256 that nano.toml records)."""
    command = [sys.executable, "-m", "trainmesh", "gpt", "--config", str(nano_toml(cwd)), f"--data.source={data}"]
    command.append("--model.vocab_size=0")
    return subprocess.run(
        [*command, *overrides], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=180, check=False
    )


def _corpus(root: Path) -> Path:
    """A folder of text files and a JSON Lines file: about 60,000 GPT-2 tokens of word salad."""
    rng = np.random.default_rng(0)
    words = np.array(["the", "model", "reads", "tokens", "from", "shards", "and", "learns", "which", "word", "."])
    folder = root / "corpus"
    folder.mkdir()
    for i in range(3):
        (folder / f"book{i}.txt").write_text(" ".join(rng.choice(words, 15_000)))
    lines = [json.dumps({"text": " ".join(rng.choice(words, 50))}) for _ in range(100)]
    (folder / "notes.jsonl").write_text("\n".join(lines))
    return folder


def test_prepare_then_train_gpt_on_the_prepared_folder(tmp_path: Path) -> None:
    prepared = _trainmesh(
        tmp_path, "data", "prepare", str(_corpus(tmp_path)), "--out", "data", "--tokenizer", "gpt2", "--workers", "2"
    )
    assert prepared.returncode == 0, prepared.stderr[-3000:]
    assert "train on it with: trainmesh run gpt --data.source=data --data.tokenizer=gpt2" in prepared.stdout
    assert "tokenised 4 input(s)" in prepared.stderr and "103 document(s)" in prepared.stderr
    result = _train(tmp_path, tmp_path / "data", "--data.tokenizer=gpt2", "--sample.max_new_tokens=8", "--run.id=p")
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs" / "p" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if r["kind"] == "train"]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(50257)) < 1.0  # GPT-2's vocabulary, from the manifest
    assert "sample from the trained model" in result.stderr  # decoded with the manifest's tokenizer


def test_sigterm_stops_prepare_leaving_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM's default action ended the process on the spot and left its staging folder; now it is removed,
    the workers stopped, and the exit code is 143 (128 + SIGTERM)."""
    import psutil

    line = " ".join(f"word{i % 97} and more text" for i in range(40)) + "\n"
    with (tmp_path / "big.txt").open("w") as f:
        for _ in range(40 << 20 >> 11):  # 40 MiB: far more than the seconds this test waits
            f.write(line * 2)
    command = [sys.executable, "-m", "trainmesh.cli", "data", "prepare", "big.txt", "--out", "data"]
    process = subprocess.Popen(
        [*command, "--tokenizer", "gpt2", "--workers", "2", "--no-progress"],
        cwd=tmp_path,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob(".data.partial-*/*.bin")):  # tokenising, and writing shards
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()
            time.sleep(0.02)
        workers = psutil.Process(process.pid).children()
        assert len(workers) >= 2
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=60)
    finally:  # on a failure: no process of this test outlives it (orphaned workers wait for tasks forever)
        for p in [process, *workers]:
            with contextlib.suppress(ProcessLookupError, psutil.NoSuchProcess):
                p.kill()
    assert process.returncode == 143, err[-3000:]
    assert "terminated (SIGTERM): nothing was written to data" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.txt"]
    _, alive = psutil.wait_procs(workers, timeout=20)  # the workers (and multiprocessing's resource tracker)
    assert not alive, [w.cmdline() for w in alive]


def test_bad_inputs_exit_2_saying_what_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.chdir(tmp_path)
    Path("in").mkdir()
    Path("in/a.txt").write_text("text\n" * 100)
    Path("bad.jsonl").write_text('{"text": "fine"}\n{"body": "no text field"}\n')
    Path("deep.jsonl").write_text("[" * 100_000)  # was a RecursionError's traceback
    pq.write_table(pa.table({"text": ["a"]}), "d.parquet")
    cases = [
        (["nothing.txt"], "input 'nothing.txt' does not exist"),
        (["in", "--tokenizer", "bpe"], "--tokenizer='bpe' is unknown; registered: byte, gpt2"),
        (["bad.jsonl"], "bad.jsonl:2: no field 'text' (its fields: body). Fix: --text-field="),
        (["deep.jsonl"], "deep.jsonl:1: JSON nested more deeply than Python's parser reads"),
        (["in", "--out", "in/tokens"], "--out='in/tokens' is inside the input folder 'in'"),
        (["in", "--workers", "-1"], "--workers=-1: a count of processes"),
    ]
    for args, message in cases:
        out = [] if "--out" in args else ["--out", "out"]
        assert main(["data", "prepare", *args, *out]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, args
    assert main(["data", "prepare", "in", "--out", "out"]) == 0
    assert main(["data", "prepare", "in", "--out", "out"]) == 2
    assert "--out='out' exists and is not empty (an earlier prepare's output). Fix: --force" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    assert main(["data", "prepare", "d.parquet", "--out", "p"]) == 2
    assert "needs the Python package 'pyarrow', which is not installed. Fix: pip install 'trainmesh[data]'" in (
        capsys.readouterr().err
    )


def test_a_damaged_shard_stops_training_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("words to learn from " * 3000)
    assert main(["data", "prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "data"), "--no-progress"]) == 0
    shard = tmp_path / "data" / "data_train_000000.bin"
    with shard.open("r+b") as f:
        f.seek(4)
        f.write(np.array([9], dtype="<i4").tobytes())  # llm.c's version field
    result = _train(tmp_path, tmp_path / "data", "--run.id=bad")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"token shard {shard} is an llm.c shard of version 9" in result.stderr
    assert "Traceback" not in result.stderr
