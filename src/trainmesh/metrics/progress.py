"""Rank 0's training progress: step, loss, lr, tokens/s and ETA.

On a terminal a tqdm bar redraws in place (as `trainmesh data prepare`'s does); when stderr is a file or pipe
(CI, nohup) the same information is logged as plain lines at each metrics step instead.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from tqdm import tqdm

from trainmesh.core.logging import get_logger

log = get_logger(__name__)

BAR_FORMAT = "[{bar:24}] step {n_fmt}/{total_fmt} | {desc} | ETA {remaining}"  # desc: loss, lr and tokens/s


class ProgressBar:
    """Shows each `update` on a live bar on a terminal, as a log line elsewhere, and nowhere when not `enabled`."""

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total = total_steps
        self.start_step = start_step
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.live = enabled and self.stream.isatty()
        self.t0 = time.perf_counter()
        self._bar: tqdm[Any] | None = None
        self._drawn = False  # the bar has had an update (a message before then needs no clearing and redrawing)
        if self.live:
            self._bar = tqdm(
                total=total_steps,
                initial=start_step,
                file=self.stream,
                bar_format=BAR_FORMAT,
                dynamic_ncols=True,
                smoothing=0,  # the ETA from the average step time since start_step, not the last few steps
                delay=1e-9,  # nothing drawn before the first update: the loss is not known yet
            )

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float | None) -> None:
        """`step` optimizer steps are done."""
        if not self.enabled:
            return
        speed = f" | {tokens_per_s:,.0f} tok/s" if tokens_per_s else ""
        stats = f"loss {loss:.4f} | lr {lr:.2e}{speed}"
        if self._bar is not None:
            self._bar.set_description_str(stats, refresh=False)
            self._bar.update(step - self._bar.n)
            self._drawn = True
        else:
            done = step - self.start_step
            eta = (time.perf_counter() - self.t0) / done * (self.total - step) if done > 0 else 0.0
            log.info("step %d/%d | %s | ETA %s", step, self.total, stats, tqdm.format_interval(max(0.0, eta)))

    def message(self, text: str) -> None:
        """Log a line without tearing the bar: the bar is cleared, the line written, and the bar drawn below it."""
        if self._bar is None or not self._drawn:
            log.info(text)
            return
        with tqdm.external_write_mode(file=self.stream):
            log.info(text)

    def close(self) -> None:
        """Leave the bar's final state on its own line (none when it never showed a step)."""
        if self._bar is not None:
            self._bar.disable = not self._drawn  # a disabled bar closes without drawing
            self._bar.close()
            self._bar = None
