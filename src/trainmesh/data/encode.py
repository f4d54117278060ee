"""Pieces of text to token ids, in worker processes, in the order of the pieces (the same token stream for any number of
workers), each document after the tokenizer's `eot`.

Details: docs/internals.md#dataencodepy
"""

from __future__ import annotations

import multiprocessing
import signal
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple, TypeVar

import numpy as np

from trainmesh.core.errors import UserError
from trainmesh.core.signals import signals_held
from trainmesh.data.textstream import Piece
from trainmesh.data.tokenizer import Tokenizer, get_tokenizer

TASK_CHARS = 1 << 20
IN_FLIGHT_PER_WORKER = 2
STOP_POLL_SECONDS = 0.1
T = TypeVar("T")


class WorkerDiedError(UserError, RuntimeError):
    """A tokenising worker process ended without returning its result."""


class Task(NamedTuple):
    pieces: list[tuple[str, bool]]
    """(text, starts a document)"""
    source_bytes: int


class Encoded(NamedTuple):
    tokens: np.ndarray
    """uint16 ids, the document separators included"""
    document_starts: np.ndarray
    """offsets into `tokens` where a document starts (at its separator)"""
    source_bytes: int


def encode_pieces(pieces: Iterable[Piece], tokenizer: Tokenizer, workers: int) -> Iterator[Encoded]:
    """The pieces' tokens, task by task, in order: by `tokenizer` here, or by one of its name in each worker."""
    tasks = _tasks(pieces)
    if workers <= 1:
        for task in tasks:
            yield encode_task(tokenizer, task)
        return
    try:
        yield from _encode_in_pool(tasks, tokenizer.name, workers)
    except BrokenProcessPool as e:
        raise WorkerDiedError(
            f"a tokenising worker process died before returning its result ({str(e).rstrip('.')}). Likely causes: "
            "it was killed for memory (the kernel's OOM killer: see dmesg); or it could not start (its own error is "
            'printed above): prepare called from a script without if __name__ == "__main__": around it (spawned '
            "workers import the main module, which then starts prepare again), or a tokenizer that a new process "
            "does not know (register_tokenizer called other than at a module's top level). Fix: fewer --workers, "
            'or --workers=1 (tokenise in this process); put the call under if __name__ == "__main__":; register '
            "the tokenizer at a module's top level."
        ) from None


def _encode_in_pool(tasks: Iterator[Task], tokenizer_name: str, workers: int) -> Iterator[Encoded]:
    context = multiprocessing.get_context("spawn")
    pool = _uninterrupted(ProcessPoolExecutor, workers, context, initializer=_start_worker, initargs=(tokenizer_name,))
    try:
        in_flight: deque[Future[Encoded]] = deque()
        for task in tasks:
            in_flight.append(_uninterrupted(pool.submit, _encode_in_worker, task))
            if len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                yield _result(in_flight.popleft())
        while in_flight:
            yield _result(in_flight.popleft())
    finally:  # also on an error or a stop: queued tasks are dropped, the running ones end
        _uninterrupted(pool.shutdown, wait=True, cancel_futures=True)


def _result(future: Future[Encoded]) -> Encoded:
    """The task's tokens, waited for in short, uninterrupted waits: a stop signal acts between them."""
    while not _uninterrupted(wait, [future], timeout=STOP_POLL_SECONDS).done:
        pass
    return _uninterrupted(future.result)


def _uninterrupted(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`call(...)` into concurrent.futures with stop signals (Ctrl-C, SIGTERM) held, then delivered: their
    exception is raised here, never between two lines of the pool's code, where it could leave a lock taken or a
    task registered but never queued, and the shutdown would wait for that task forever (a SIGTERM'd prepare
    hung in CI that way)."""
    with signals_held():
        return call(*args, **kwargs)


def encode_task(tokenizer: Tokenizer, task: Task) -> Encoded:
    parts: list[np.ndarray] = []
    starts: list[int] = []
    count = 0
    separator = None if tokenizer.eot is None else np.array([tokenizer.eot], dtype=np.uint16)
    for text, starts_document in task.pieces:
        if starts_document:
            starts.append(count)
            if separator is not None:
                parts.append(separator)
                count += 1
        ids = tokenizer.encode(text).astype(np.uint16, copy=False)  # ids fit: prepare checked the vocabulary
        parts.append(ids)
        count += len(ids)
    tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint16)
    return Encoded(tokens, np.array(starts, dtype=np.int64), task.source_bytes)


def _tasks(pieces: Iterable[Piece]) -> Iterator[Task]:
    batch: list[tuple[str, bool]] = []
    chars = source_bytes = 0
    for piece in pieces:
        batch.append((piece.text, piece.starts_document))
        chars += len(piece.text)
        source_bytes += piece.source_bytes
        if chars >= TASK_CHARS:
            yield Task(batch, source_bytes)
            batch, chars, source_bytes = [], 0, 0
    if batch:
        yield Task(batch, source_bytes)


_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_name: str) -> None:
    global _worker_tokenizer
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group: the main process stops the pool
    _worker_tokenizer = get_tokenizer(tokenizer_name)


def _encode_in_worker(task: Task) -> Encoded:
    assert _worker_tokenizer is not None
    return encode_task(_worker_tokenizer, task)
