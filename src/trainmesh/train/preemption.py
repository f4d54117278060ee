"""Graceful preemption: SIGTERM asks the job to stop at the next step boundary, with a checkpoint.

Schedulers (SLURM, Kubernetes, spot instances) send SIGTERM and allow some seconds before SIGKILL;
torchrun's agent forwards it to the workers and waits up to 30 s. The handler only records the
request; the loop adds it to the all-reduce every step already makes (the target count), so all ranks
learn of it at the same step, save a checkpoint together and exit with `EXIT_PREEMPTED`. Relaunching
with --resume continues exactly where the job stopped.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: "try again later"


class PreemptionWatch:
    """Records SIGTERM while installed (a context manager; the previous handler is restored)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: object = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        del signum, frame
        self.requested = True

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)  # type: ignore[arg-type]
