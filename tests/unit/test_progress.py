"""Rank 0's training progress (metrics/progress.py): a tqdm bar on a terminal, log lines elsewhere, nothing when off."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from trainmesh.metrics.progress import ProgressBar

pytestmark = pytest.mark.timeout(60)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def logged() -> Iterator[list[str]]:
    """The progress module's log lines, whatever the trainmesh logger's handlers and level."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("trainmesh.metrics.progress")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_off_a_terminal_each_update_is_a_log_line(logged: list[str]) -> None:
    stream = io.StringIO()
    bar = ProgressBar(20, start_step=10, stream=stream)
    bar.update(15, 1.23456, 3e-4, 17066.4)
    bar.update(20, 0.5, 1e-3, None)
    bar.message("step 20: val loss 0.4000")
    bar.close()
    assert logged[0].startswith("step 15/20 | loss 1.2346 | lr 3.00e-04 | 17,066 tok/s | ETA ")
    assert logged[1:] == ["step 20/20 | loss 0.5000 | lr 1.00e-03 | ETA 00:00", "step 20: val loss 0.4000"]
    assert stream.getvalue() == ""


def test_on_a_terminal_a_bar_is_drawn_and_left_on_its_own_line(logged: list[str]) -> None:
    stream = Terminal()
    bar = ProgressBar(20, start_step=10, stream=stream)
    assert stream.getvalue() == ""  # nothing before the first update: no loss to show yet
    bar.update(15, 1.23456, 3e-4, 17066.4)
    bar.message("step 15: val loss 1.0000")
    bar.update(20, 0.5, 1e-3, 17066.4)
    bar.close()
    drawn = stream.getvalue()
    assert "step 20/20 | loss 0.5000 | lr 1.00e-03 | 17,066 tok/s | ETA " in drawn and drawn.endswith("\n")
    assert logged == ["step 15: val loss 1.0000"]  # the updates are on the bar, not in the log


def test_disabled_shows_nothing(logged: list[str]) -> None:
    stream = Terminal()
    bar = ProgressBar(20, enabled=False, stream=stream)
    bar.update(5, 1.0, 1e-3, 100.0)
    bar.close()
    assert stream.getvalue() == "" and logged == []


def test_a_bar_that_showed_no_step_closes_without_drawing(logged: list[str]) -> None:
    """A resumed run already at train.max_steps trains no step: no empty bar."""
    stream = Terminal()
    ProgressBar(20, start_step=20, stream=stream).close()
    assert stream.getvalue() == "" and logged == []
