"""Where each step's time goes: data, forward, sync, backward, optimizer and other, per rank.

The step's phases mark where each begins (`clock.mark("forward")`, through metrics/profiler.py); a phase
lasts until the next mark. On the CPU the clock reads host timers. On CUDA it records CUDA events on the
current stream and measures between them only when the metrics window closes, so the hot path never waits
for the device; the figures are then GPU time between the marks, in which the host's waits (for data, say)
show as the gaps they leave on the device.

    data       fetching this rank's micro-batches (a loader that keeps up costs almost nothing here)
    forward    the forward passes (under pipeline parallelism: the whole schedule, forward and backward)
    sync       waiting for the step's all-reduce of the target count, issued before the first forward:
               the time this rank waits for its slowest peer to have read its batch
    backward   the backward passes (with DDP, up to the moment its last gradient bucket is handed to the
               network; elsewhere, including any wait for gradient communication)
    comm       ddp: the exposed gradient communication, waited for after the last gradient was ready
               (the part of DDP's all-reduce that backward could not hide)
    optimizer  unscale, clip, optimizer step, zero_grad
    other      everything else in the loop: logging, hooks
    eval, checkpoint   reported separately, as totals per window (not training-step time)

Every rank measures its own; `MetricsWindow` brings them to rank 0 on the all-reduce each step makes
anyway, to report the slowest rank and the spread. A rank's `compute` time leaves out sync, backward and
comm, where data parallelism makes every rank wait for the slowest: a straggler shows in it.
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
