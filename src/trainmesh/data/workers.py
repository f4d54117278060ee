"""DataLoader worker processes ignore SIGTERM and SIGINT: the training process owns shutdown, so a preemption reaches
the step boundary where it saves.

Details: docs/internals.md#dataworkerspy
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def ignore_stop_signals() -> None:
    """Make this process ignore SIGTERM and SIGINT (SIGKILL still ends it)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class WorkerInit:
    """A DataLoader `worker_init_fn`: ignore the stop signals, then run `then` (the loader's own, if any).
    A class rather than a closure so it pickles for the spawn start method."""

    def __init__(self, then: Callable[[int], None] | None = None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        ignore_stop_signals()
        if self.then is not None:
            self.then(worker_id)


def worker_init(then: Callable[[int], None] | None = None) -> WorkerInit:
    """`then` wrapped so workers ignore the stop signals first; wrapping twice adds nothing."""
    return then if isinstance(then, WorkerInit) else WorkerInit(then)


class Batches(Iterator[Any]):
    """A loader's batches until `close`, which lets its worker processes go. The loader's own iterator lives as long
    as anything holds it, and an error's traceback (or one matplotlib's first import keeps) holds every frame it
    passed through to the end of the process, whose exit then waits forever on workers that ignore SIGTERM. Frames
    hold this wrapper instead, and `close` drops the iterator inside it."""

    def __init__(self, loader: Iterable[Any]) -> None:
        self._batches: Iterator[Any] = iter(loader)

    def __next__(self) -> Any:
        return next(self._batches)

    def close(self) -> None:
        self._batches = iter(())
