"""What `trainmesh data prepare` refuses, with messages that say how to fix it; an interrupted run leaves
nothing behind; and memory stays flat on a corpus larger than the memory it may use."""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainmesh.core.errors import UserError
from trainmesh.core.signals import Terminated, signals_held, sigterm_raises
from trainmesh.data import prepare as prepare_module
from trainmesh.data import tokenizer as tokenizer_module
from trainmesh.data.prepare import PrepareOptions, prepare
from trainmesh.data.tokenizer import ByteTokenizer


def run(tmp_path: Path, *inputs: Path, out: str = "out", **options: Any) -> None:
    prepare(PrepareOptions(inputs=inputs, out=tmp_path / out, progress=False, **options))


def refused(message: str, tmp_path: Path, *inputs: Path, **options: Any) -> None:
    with pytest.raises(UserError, match=message):
        run(tmp_path, *inputs, **options)


@pytest.fixture
def text(tmp_path: Path) -> Path:
    path = tmp_path / "in" / "a.txt"
    path.parent.mkdir()
    path.write_text("some text\n" * 100)
    return path


def test_missing_inputs_and_unknown_tokenizers_are_refused(tmp_path: Path, text: Path) -> None:
    refused(r"input '.*nothing.txt' does not exist", tmp_path, tmp_path / "nothing.txt")
    refused(
        r"--tokenizer='bpe' is unknown; registered: byte, gpt2. Fix: --tokenizer=gpt2", tmp_path, text, tokenizer="bpe"
    )
    (tmp_path / "empty").mkdir()
    refused(r"input folder '.*empty' holds no file prepare reads", tmp_path, tmp_path / "empty")
    (tmp_path / "a.zst").write_bytes(b"\x28\xb5\x2f\xfd")
    refused(r"a.zst' is compressed in a format prepare does not read.*zstd -d", tmp_path, tmp_path / "a.zst")
    refused(r"would be read twice", tmp_path, text, text.parent)
    refused(r"--val-fraction=0.7: .* at most 0.5", tmp_path, text, val_fraction=0.7)
    refused(r"--shard-tokens=0: a shard holds 1 to 2,147,483,647 tokens", tmp_path, text, shard_tokens=0)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"bad.jsonl:2: not JSON \(Expecting property name.*\). .*one JSON object per line"),
        ('{"body": "x", "id": 1}', r"bad.jsonl:2: no field 'text' \(its fields: body, id\). Fix: --text-field="),
        ('{"text": null}', r"bad.jsonl:2: 'text' is null, not a string"),
        ('["text"]', r"bad.jsonl:2: a JSON list, not an object with a 'text' field"),
    ],
)
def test_a_bad_json_line_stops_the_run_naming_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    (tmp_path / "bad.jsonl").write_text('{"text": "good"}\n' + line + "\n")
    refused(message, tmp_path, tmp_path / "bad.jsonl")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.partial-*"))


def test_parquet_and_datasets_without_their_packages_and_a_missing_column(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without pyarrow, looking for `pyarrow.parquet` raised ModuleNotFoundError (a traceback): it imports
    `pyarrow` first. A package not installed is simulated as an import sees it: None in sys.modules, no submodule."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a", "b"]}), tmp_path / "d.parquet")
    refused(
        r"d.parquet has no column 'text' \(its columns: body\). Fix: --text-field=", tmp_path, tmp_path / "d.parquet"
    )
    for package in ("pyarrow", "datasets"):
        for name in [n for n in sys.modules if n.startswith(f"{package}.")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.setitem(sys.modules, package, None)
    refused(
        r"needs the Python package 'pyarrow'.*Fix: pip install 'trainmesh\[data\]'", tmp_path, tmp_path / "d.parquet"
    )
    saved = tmp_path / "saved"  # a saved dataset as find_sources tells one: refused before a file of it is read
    saved.mkdir()
    (saved / "state.json").write_text("{}")
    (saved / "dataset_info.json").write_text("{}")
    refused(r"saved \(hf\) needs the Python package 'datasets'.*Fix: pip install 'trainmesh\[data\]'", tmp_path, saved)


def test_out_is_never_an_input_and_is_replaced_only_with_force(tmp_path: Path, text: Path) -> None:
    refused(
        r"--out='.*in/out' is inside the input folder '.*in': prepare would read its own output",
        tmp_path,
        text.parent,
        out="in/out",
    )
    refused(r"the input '.*a.txt' is inside --out='.*in', which prepare replaces", tmp_path, text, out="in")
    run(tmp_path, text)
    refused(r"--out='.*out' exists and is not empty \(an earlier prepare's output\). Fix: --force", tmp_path, text)
    before = (tmp_path / "out" / "manifest.json").read_text()
    run(tmp_path, text, force=True, val_fraction=0.1)
    assert (tmp_path / "out" / "manifest.json").read_text() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no staging or old folder left
    (tmp_path / "empty").mkdir()
    run(tmp_path, text, out="empty", force=True)
    assert (tmp_path / "empty" / "manifest.json").is_file()


def test_force_never_replaces_a_folder_an_earlier_prepare_did_not_write(tmp_path: Path, text: Path) -> None:
    """--force replaced any folder (a user's thesis folder vanished): now only an empty one or a prepare's output,
    which is its manifest.json (of trainmesh's format) and the shards it lists, and nothing else."""
    thesis = tmp_path / "thesis"
    thesis.mkdir()
    for name in ("chapter1.tex", "chapter2.tex", "figures", "main.tex", "refs.bib", "x.sty", "y.cls"):
        (thesis / name).write_text(name)
    refused(
        r"--out='.*thesis' is not the output of an earlier trainmesh data prepare \(it has no manifest.json of "
        r"trainmesh's\) and holds chapter1.tex, chapter2.tex, figures, main.tex, refs.bib and 2 more, so it is not "
        r"replaced, with --force or without.*Fix: another --out, or remove '.*thesis' yourself",
        tmp_path,
        text,
        out="thesis",
        force=True,
    )
    assert len(list(thesis.iterdir())) == 7
    (thesis / "manifest.json").write_text(json.dumps({"format": "something else", "splits": {}}))
    refused(r"thesis' is not the output of an earlier trainmesh data prepare", tmp_path, text, out="thesis", force=True)
    listed = [{"file": name} for name in os.listdir(thesis)]  # trainmesh's format, listing what is not a shard
    (thesis / "manifest.json").write_text(
        json.dumps({"format": "trainmesh-tokens", "splits": {"train": {"shards": listed}}})
    )
    refused(
        r"thesis' holds files an earlier trainmesh data prepare did not write \(chapter1.tex, ",
        tmp_path,
        text,
        out="thesis",
        force=True,
    )
    run(tmp_path, text)
    (tmp_path / "out" / "notes.txt").write_text("mine")
    refused(
        r"--out='.*out' holds files an earlier trainmesh data prepare did not write \(notes.txt\)",
        tmp_path,
        text,
        force=True,
    )
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out", "thesis"]


@pytest.mark.parametrize("made", ["a full folder", "an empty folder", "a full one where an empty one was"])
def test_an_out_that_appears_during_the_run_is_not_taken_without_force(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path, made: str
) -> None:
    """--out is checked at the start and again at the commit: another process's folder made there meanwhile is
    never moved aside and deleted (it was), and an empty --out accepted at the start goes only if still empty."""
    out = tmp_path / "out"
    if made.endswith("where an empty one was"):
        out.mkdir()
    real = prepare_module.build

    def racing(*args: Any, **kwargs: Any) -> Any:
        manifest = real(*args, **kwargs)
        out.mkdir(exist_ok=True)
        if made != "an empty folder":
            (out / "theirs.txt").write_text("another process's")
        return manifest

    monkeypatch.setattr(prepare_module, "build", racing)
    message = "was an empty folder when prepare started" if out.exists() else "appeared while prepare ran"
    refused(rf"--out='.*out' {message}.*not replaced without --force", tmp_path, text)
    assert [p.name for p in out.iterdir()] == ([] if made == "an empty folder" else ["theirs.txt"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # the staging folder removed


def test_force_checks_out_again_at_the_commit(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path) -> None:
    run(tmp_path, text)
    real = prepare_module.build

    def meanwhile(*args: Any, **kwargs: Any) -> Any:
        (tmp_path / "out" / "notes.txt").write_text("written during the run")
        return real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "build", meanwhile)
    refused(
        r"--out='.*out' holds files an earlier trainmesh data prepare did not write \(notes.txt\)",
        tmp_path,
        text,
        force=True,
    )
    assert (tmp_path / "out" / "notes.txt").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_force_never_deletes_a_file_written_between_the_last_check_and_the_rename(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path
) -> None:
    """A file written into --out after prepare's check at the commit, as the old folder was replaced, was deleted
    with it: the folder is checked again once moved aside, and put back."""
    run(tmp_path, text)
    real = prepare_module.replace_folder

    def late(*args: Any, **kwargs: Any) -> None:
        (tmp_path / "out" / "notes.txt").write_text("written at the commit")
        real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "replace_folder", late)
    refused(r"--out='.*out' holds files an earlier trainmesh data prepare did not write \(notes.txt\)", tmp_path, text,
            force=True)  # fmt: skip
    assert (tmp_path / "out" / "notes.txt").read_text() == "written at the commit"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


def test_a_failed_commit_puts_the_old_out_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path) -> None:
    run(tmp_path, text)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    real = os.rename

    def failing(src: Any, dst: Any) -> None:
        if Path(src).name.startswith(".out.partial-"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        real(src, dst)

    monkeypatch.setattr(os, "rename", failing)
    with pytest.raises(OSError, match="cross-device"):
        run(tmp_path, text, force=True, val_fraction=0.1)
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no staging or old folder left


def test_a_symlink_or_a_nameless_out_is_refused(tmp_path: Path, text: Path) -> None:
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target", target_is_directory=True)
    for force in (False, True):  # it was replaced by a real folder, and with --force rmtree then failed on the link
        refused(
            r"--out='.*link' is a symlink \(to '.*target'\).*Fix: --out='.*target'",
            tmp_path,
            text,
            out="link",
            force=force,
        )
    assert (tmp_path / "link").is_symlink() and not any((tmp_path / "target").iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "link", "target"]
    refused(r"--out='.*in/..' does not end in a folder's name", tmp_path, text, out="in/..", force=True)
    with pytest.raises(UserError, match=r"--out='.' does not end in a folder's name"):
        prepare(PrepareOptions(inputs=(text,), out=Path("."), progress=False, force=True))


def test_ids_that_do_not_fit_uint16_and_too_little_text_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path
) -> None:
    class Wide(ByteTokenizer):
        name, vocab_size = "wide", 100_000

    monkeypatch.setitem(tokenizer_module._TOKENIZERS, "wide", Wide)
    refused(
        r"tokenizer 'wide' has 100,000 token ids; the shards store uint16 ids .* hold 65,536",
        tmp_path,
        text,
        tokenizer="wide",
    )
    (tmp_path / "one.txt").write_text("x")
    refused(r"the inputs hold 1 token\(s\): too few for a train and a validation split", tmp_path, tmp_path / "one.txt")


def test_an_input_that_vanishes_or_a_worker_that_dies_is_an_error_that_names_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path
) -> None:
    """Both were tracebacks: an input gone between finding and hashing it (OSError), and a worker that dies
    (BrokenProcessPool; here a tokenizer registered in this process only, which the spawned workers lack)."""
    real = prepare_module.find_sources

    def then_removed(inputs: Any) -> Any:
        found = real(inputs)
        text.unlink()
        return found

    monkeypatch.setattr(prepare_module, "find_sources", then_removed)
    refused(r"cannot read input .*a.txt: No such file or directory", tmp_path, text)
    monkeypatch.setattr(prepare_module, "find_sources", real)
    text.write_text("some text\n" * 100)

    class Local(ByteTokenizer):
        name = "local"

    monkeypatch.setitem(tokenizer_module._TOKENIZERS, "local", Local)
    refused(
        r"a tokenising worker process died before returning its result .*killed for memory.*"
        r"if __name__ == \"__main__\".*Fix: fewer --workers, or --workers=1",
        tmp_path,
        text,
        tokenizer="local",
        workers=2,
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_script_without_a_main_guard_gets_the_fix_not_a_broken_pool(tmp_path: Path, text: Path) -> None:
    script = f"""
from pathlib import Path
from trainmesh.data.prepare import PrepareOptions, prepare
prepare(PrepareOptions((Path({str(text)!r}),), Path({str(tmp_path / "out")!r}), workers=2, progress=False))
"""
    (tmp_path / "unguarded.py").write_text(script)
    result = subprocess.run(
        [sys.executable, str(tmp_path / "unguarded.py")], capture_output=True, text=True, timeout=100, check=False
    )
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("trainmesh.data.encode.WorkerDiedError: a tokenising worker process died"), last
    assert 'without if __name__ == "__main__":' in last and "BrokenProcessPool" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "unguarded.py"]


def test_an_interrupted_prepare_leaves_no_folder_behind(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path
) -> None:
    real = prepare_module.encode_pieces

    def interrupted(*args: Any) -> Iterator[Any]:
        yield next(iter(real(*args)))
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "encode_pieces", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, text, shard_tokens=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_stop_signal_during_the_commit_waits_for_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, text: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """SIGTERM (as the CLI installs it) or Ctrl-C between moving the old --out aside and renaming the new one
    into place would lose both; they wait, and once the data is in place prepare finishes."""
    run(tmp_path, text)
    real = prepare_module.replace_folder

    def signalled(*args: Any, **kwargs: Any) -> None:
        signal.raise_signal(signal.SIGTERM)  # its handler would raise here, before anything is renamed
        real(*args, **kwargs)

    monkeypatch.setattr(prepare_module, "replace_folder", signalled)
    with sigterm_raises(), caplog.at_level("WARNING", logger="trainmesh"):
        run(tmp_path, text, force=True, val_fraction=0.1)
    assert "SIGTERM arrived as" in caplog.text and json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]
    with sigterm_raises(), pytest.raises(Terminated):  # anywhere else it stops prepare, which cleans up
        monkeypatch.setattr(prepare_module, "build", lambda *args, **kwargs: signal.raise_signal(signal.SIGTERM))
        run(tmp_path, text, force=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]


@pytest.mark.slow
@pytest.mark.parametrize("at", ["submit", "wait", "result"])
def test_a_stop_inside_the_pools_calls_waits_for_its_shutdown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, at: str
) -> None:
    """Terminated raised between two lines of concurrent.futures (a task registered but not yet queued) left
    the pool's shutdown waiting forever: a SIGTERM'd prepare hung in CI. A stop is held while the pool runs
    one of its calls, and delivered as it returns; the pool is then shut down, dropping queued tasks."""
    from concurrent.futures import Future, ProcessPoolExecutor

    from trainmesh.data import encode

    events: list[str] = []
    calls = {"submit": 0, "wait": 0, "result": 0}

    def signalled(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            if name != at or calls[name] != 3:
                return real(*args, **kwargs)
            events.append("signalled")
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, inside the pool's call
            returned = real(*args, **kwargs)
            events.append("returned")
            return returned

        return call

    def shutdown(self: ProcessPoolExecutor, wait: bool = True, *, cancel_futures: bool = False) -> None:
        real_shutdown(self, wait, cancel_futures=cancel_futures)
        events.append(f"shutdown, cancel_futures={cancel_futures}")

    real_shutdown = ProcessPoolExecutor.shutdown
    monkeypatch.setattr(ProcessPoolExecutor, "submit", signalled("submit", ProcessPoolExecutor.submit))
    monkeypatch.setattr(encode, "wait", signalled("wait", encode.wait))
    monkeypatch.setattr(Future, "result", signalled("result", Future.result))
    monkeypatch.setattr(ProcessPoolExecutor, "shutdown", shutdown)
    monkeypatch.setattr(encode, "TASK_CHARS", 100)  # a task per document: enough for a few submits and results
    documents = tmp_path / "documents.jsonl"
    documents.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(40)))
    with sigterm_raises(), pytest.raises(Terminated):
        prepare(PrepareOptions((documents,), tmp_path / "out", workers=2, progress=False))
    assert events == ["signalled", "returned", "shutdown, cancel_futures=True"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["documents.jsonl"]


def test_held_signals_leave_an_ignored_one_ignored() -> None:
    """A job started in the background of a script ignores SIGINT; holding it must not turn it into a stop."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with signals_held() as received:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGTERM)  # recorded: delivered on leaving, to the handler installed here
            assert received == [signal.SIGTERM] and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            received.clear()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_task_that_raises_timeout_error_is_an_error_not_a_wait() -> None:
    """Waiting with result(timeout=...) took a task's own TimeoutError for "not done yet", and spun forever."""
    from concurrent.futures import Future

    from trainmesh.data.encode import _result

    future: Future[Any] = Future()
    future.set_exception(TimeoutError("the task's own"))
    with pytest.raises(TimeoutError, match="the task's own"):
        _result(future)


def test_memory_stays_flat_on_a_corpus_larger_than_the_memory_cap(tmp_path: Path) -> None:
    """300 MiB of text through 2 workers in a process whose data segment may not exceed 160 MiB: the text is
    streamed, never held (the prepare modules import no torch, so the process stays small).

    The peak resident memory of the process is its VmHWM, counted from its exec: its ru_maxrss would also count
    the pages it shared with pytest between fork and exec. The workers' is their ru_maxrss (forked from it)."""
    block = b"".join(b"line %d of a text larger than the memory prepare may use\n" % i for i in range(20_000))
    corpus = tmp_path / "big.txt"
    with corpus.open("wb") as f:
        for _ in range(300 * 2**20 // len(block) + 1):
            f.write(block)
    size, cap = corpus.stat().st_size, 160 * 2**20
    script = textwrap.dedent(f"""
        import json, re, resource, sys
        from pathlib import Path
        from trainmesh.data.prepare import PrepareOptions, prepare
        if __name__ == "__main__":
            done = prepare(PrepareOptions((Path({str(corpus)!r}),), Path({str(tmp_path / "out")!r}), workers=2))
            status = Path("/proc/self/status").read_text()
            print(json.dumps({{
                "tokens": done.manifest.train.tokens + done.manifest.val.tokens,
                "peak_kib": int(re.search(r"VmHWM:\\s+(\\d+) kB", status).group(1)),
                "workers_peak_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                "torch": "torch" in sys.modules,
            }}))
    """)
    (tmp_path / "measure.py").write_text(script)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))

    result = subprocess.run(
        [sys.executable, str(tmp_path / "measure.py")], preexec_fn=limit, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["tokens"] == size and not report["torch"]  # bytes: a token each
    assert max(report["peak_kib"], report["workers_peak_kib"]) * 1024 < cap < size / 1.8, report
    tokens = np.memmap(next((tmp_path / "out").glob("out_val_*.bin")), dtype=np.uint16, mode="r", offset=1024)
    assert re.fullmatch(rb"[a-z0-9 \n]+", bytes(tokens[:4096].astype(np.uint8)))
    corpus.unlink()  # 900 MB of files not kept in pytest's temporary folders
    for shard in (tmp_path / "out").glob("*.bin"):
        shard.unlink()
