"""The step-time breakdown's clock on the CPU, driven by a timer the test moves: each phase lasts until the next
mark, `take` cuts the phase under way and starts the next window at zero (the records across ranks:
tests/distributed/test_breakdown.py)."""

from __future__ import annotations

import torch

from trainmesh.metrics.breakdown import PAUSES, PHASES, StepClock, describe


class Timer:
    """Seconds that pass only when the test says (whole and half seconds: the sums are exact)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_clock_counts_each_phase_until_the_next_mark() -> None:
    timer = Timer()
    clock = StepClock(torch.device("cpu"), now=timer)
    for phase, seconds in (("data", 2.0), ("forward", 4.0), ("eval", 1.0), ("other", 0.5)):
        clock.mark(phase)
        timer.now += seconds
    taken = clock.take()
    assert taken == {**dict.fromkeys((*PHASES, *PAUSES), 0.0), "data": 2.0, "forward": 4.0, "eval": 1.0, "other": 0.5}
    # eval is a pause, not step time: data 2 and forward 4 of 6.5 s of steps
    assert describe(taken) == (
        "data 31% | forward 62% | sync 0% | backward 0% | comm 0% | optimizer 0% | other 8% of 6.5 s of steps; "
        "besides: eval 1.0 s"
    )
    timer.now += 3.0  # "other" goes on from the cut: the next window has it alone
    assert clock.take() == {**dict.fromkeys((*PHASES, *PAUSES), 0.0), "other": 3.0}


def test_nothing_timed_says_so() -> None:
    assert StepClock(torch.device("cpu"), now=Timer()).take() == dict.fromkeys((*PHASES, *PAUSES), 0.0)
    assert describe(dict.fromkeys((*PHASES, *PAUSES), 0.0)) == "no steps timed"
