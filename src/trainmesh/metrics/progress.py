"""A live progress bar for rank 0: step, loss, lr, tokens/s and ETA on one line.

On a terminal the line redraws in place; when stderr is a file or pipe (CI, nohup) the same
information is logged as plain lines at each metrics step instead.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from trainmesh.core.logging import get_logger

log = get_logger(__name__)


def format_duration(seconds: float) -> str:
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60:02d}:{rest % 60:02d}"


class ProgressBar:
    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._drawn = False

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float | None) -> None:
        """`step` optimizer steps are done."""
        if not self.enabled:
            return
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (self.total - step) if done > 0 else 0.0
        speed = f" | {tokens_per_s:,.0f} tok/s" if tokens_per_s else ""
        text = f"step {step}/{self.total} | loss {loss:.4f} | lr {lr:.2e}{speed} | ETA {format_duration(eta)}"
        if self.live:
            width = 24
            filled = int(width * step / max(1, self.total))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}\x1b[K")
            self.stream.flush()
            self._drawn = True
        else:
            log.info(text)

    def message(self, text: str) -> None:
        """Log a line without tearing the bar."""
        self.close()
        log.info(text)

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False
