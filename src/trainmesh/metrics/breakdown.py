"""Where each step's time goes, per rank: data, forward, sync, backward, comm, optimizer and other, measured without
making the hot path wait for the device, and brought to rank 0 to show the slowest rank and the spread.

Details: docs/internals.md#metricsbreakdownpy
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

PHASES = ("data", "forward", "sync", "backward", "comm", "optimizer", "other")
PAUSES = ("eval", "checkpoint")
COMPUTE = ("data", "forward", "optimizer", "other")  # the phases in which a rank waits for no peer (ddp)


class StepClock:
    def __init__(self, device: torch.device, now: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self._now = now  # the host timer in seconds: a test gives its own, to drive the clock
        self._phase: str | None = None
        self._since: float = 0.0
        self._events: list[tuple[str, torch.cuda.Event]] = []  # CUDA: (phase that starts, its event)
        self._totals_s = dict.fromkeys((*PHASES, *PAUSES), 0.0)

    def mark(self, phase: str) -> None:
        """`phase` begins now (and the one before it ends)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append((phase, event))
            return
        now = self._now()
        if self._phase is not None:
            self._totals_s[self._phase] += now - self._since
        self._phase, self._since = phase, now

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last call (the phase under way is cut here and goes on counting)."""
        if self.cuda:
            self._resolve_events()
        else:
            self.mark(self._phase or "other")
        totals, self._totals_s = self._totals_s, dict.fromkeys(self._totals_s, 0.0)
        return totals

    def _resolve_events(self) -> None:
        if not self._events:
            return
        phase_now = self._events[-1][0]
        self.mark(phase_now)  # cut: the last interval ends here, and the phase goes on from this event
        self._events[-1][1].synchronize()
        for (phase, start), (_, end) in zip(self._events, self._events[1:], strict=False):
            self._totals_s[phase] += start.elapsed_time(end) / 1000
        self._events = self._events[-1:]


def describe(totals_s: dict[str, float]) -> str:
    """One line for the end of a run: each training phase's share of the step time, then the pauses."""
    step_s = sum(totals_s[p] for p in PHASES)
    if step_s <= 0:
        return "no steps timed"
    shares = " | ".join(f"{p} {100 * totals_s[p] / step_s:.0f}%" for p in PHASES)
    pauses = ", ".join(f"{p} {totals_s[p]:.1f} s" for p in PAUSES if totals_s[p] > 0)
    return f"{shares} of {step_s:.1f} s of steps" + (f"; besides: {pauses}" if pauses else "")
