"""Stop signals in a command that has nothing to save (`trainmesh data prepare`): SIGTERM raises `Terminated` as SIGINT
raises KeyboardInterrupt, and `signals_held` keeps a commit or cleanup whole.

Details: docs/internals.md#coresignalspy
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):  # named as KeyboardInterrupt is: a stop, not an error
    """SIGTERM arrived while `sigterm_raises` was installed."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    del signum, frame
    raise Terminated


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """While inside, SIGTERM raises `Terminated` in the main thread (elsewhere: nothing changes)."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread sets handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def signals_held() -> Iterator[list[int]]:
    """SIGINT and SIGTERM are recorded while inside and delivered again on leaving, to the handlers there
    were before (one that was ignored stays ignored). The caller may clear the yielded list of recorded signals
    to drop them (the work they would have stopped is done)."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():  # handlers run in the main thread only
        yield received
        return

    def record(signum: int, frame: FrameType | None) -> None:
        del frame
        received.append(signum)

    previous: dict[signal.Signals, Any] = {
        sig: signal.signal(sig, record)
        for sig in STOP_SIGNALS
        if signal.getsignal(sig) is not signal.SIG_IGN  # ignored (a background job's SIGINT): it stays ignored
    }
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)  # the previous handler acts now: raises, or ends the process
