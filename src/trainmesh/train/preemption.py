"""Graceful stops: SIGTERM (preemption) and SIGINT (Ctrl-C) ask the job to stop at the next step boundary, with a
checkpoint; all ranks learn of it at the same step, and --resume continues from there.

Details: docs/internals.md#trainpreemptionpy
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType

from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_SAME_PRESS_S = 1.0  # a terminal's SIGINT and the one torchrun's agent forwards arrive within this


class PreemptionWatch:
    """Records SIGTERM and SIGINT while installed (a context manager; previous handlers are restored)."""

    def __init__(self) -> None:
        self.requested = False
        self.signal: signal.Signals | None = None
        """The first stop signal received."""
        self._first_interrupt: float | None = None
        self._previous: dict[signal.Signals, object] = {}

    @property
    def vote(self) -> int:
        """This rank's stop request for the all-reduce: 0 none, 1 SIGTERM, 2 Ctrl-C (max wins: the user's)."""
        return 0 if self.signal is None else 2 if self.signal == signal.SIGINT else 1

    @staticmethod
    def exit_code(agreed_vote: int) -> int:
        """The exit code for the stop the ranks agreed on (the max of their votes)."""
        return EXIT_INTERRUPTED if agreed_vote == 2 else EXIT_PREEMPTED

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del frame
        now = time.monotonic()
        if signum == signal.SIGINT:
            if self._first_interrupt is not None and now - self._first_interrupt > _SAME_PRESS_S:
                raise KeyboardInterrupt  # Ctrl-C again: the user does not want to wait for the save
            self._first_interrupt = self._first_interrupt or now
        self.signal = self.signal or signal.Signals(signum)
        self.requested = True

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = {sig: signal.signal(sig, self._handle) for sig in _SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
