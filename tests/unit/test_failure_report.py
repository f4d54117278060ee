"""The launcher's summary of a failed launch (launch/outcome.py) names the rank that failed first, not the one
torch's agent stopped because of it, from fabricated failures as the agent reports them."""

from __future__ import annotations

import signal

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainmesh.launch.outcome import explain_failure, first_failure


def failure(rank: int, exitcode: int, timestamp: int) -> ProcessFailure:
    """A rank's failure without an error file, dated as the agent dates it (whole seconds)."""
    failed = ProcessFailure(rank, 100 + rank, exitcode, "")
    failed.timestamp = timestamp
    return failed


def said(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records]


def test_a_rank_the_agent_stopped_is_not_blamed_for_the_crash_that_made_it_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Seen: rank 0 segfaults; rank 1's collective fails at once and it writes its error file, dated in the second
    before the agent notices rank 0 (a failure without an error file is dated when the agent notices it); the agent
    then SIGTERMs rank 1. By timestamp alone, rank 1 "failed first"."""
    failures = {0: failure(0, -signal.SIGSEGV, 1001), 1: failure(1, -signal.SIGTERM, 1000)}
    assert explain_failure(ChildFailedError("entry", failures), None, worker=True) == 1
    assert said(caplog)[0] == "rank 0 failed first: killed by signal SIGSEGV (-11)"
    assert said(caplog)[-1] == "rank 1 then: killed by signal SIGTERM (-15)"


@pytest.mark.parametrize(("crashed_at", "follower_at"), [(1001, 1000), (1000, 1000), (1001, 1001)])
def test_a_crash_comes_before_the_exception_it_caused_in_the_same_second(crashed_at: int, follower_at: int) -> None:
    """Seen: rank 1 segfaults and rank 0's all-reduce raises at once ("Connection closed by peer": exit code 1, an
    error file dated when it raised); rank 1 has no error file and is dated when the agent noticed it, up to a
    second later in whole seconds. Rank 0 comes first in the failures, so ties went to it."""
    failures = {0: failure(0, 1, follower_at), 1: failure(1, -signal.SIGSEGV, crashed_at)}
    assert first_failure(ChildFailedError("entry", failures))[0] == 1


def test_an_abort_in_the_same_second_as_an_exception_is_not_taken_for_its_cause() -> None:
    """NCCL's watchdog aborts a rank (SIGABRT) within a second of a peer's exception."""
    failures = {0: failure(0, -signal.SIGABRT, 1001), 1: failure(1, 1, 1001)}
    assert first_failure(ChildFailedError("entry", failures))[0] == 1


def test_an_exception_more_than_a_second_before_a_crash_is_still_first() -> None:
    failures = {0: failure(0, -signal.SIGABRT, 1002), 1: failure(1, 1, 1000)}
    assert first_failure(ChildFailedError("entry", failures))[0] == 1


def test_otherwise_the_earliest_failure_is_named_first(caplog: pytest.LogCaptureFixture) -> None:
    """Every rank ended by SIGTERM (sent by something else than the agent): their times decide, as between ranks
    that failed on their own."""
    failures = {0: failure(0, -signal.SIGTERM, 1001), 1: failure(1, -signal.SIGTERM, 1000)}
    explain_failure(ChildFailedError("entry", failures), None, worker=False)
    assert said(caplog)[0] == "rank 1 failed first: killed by signal SIGTERM (-15)"
    caplog.clear()
    failures = {0: failure(0, 1, 1001), 1: failure(1, 1, 1000)}
    explain_failure(ChildFailedError("entry", failures), None, worker=False)
    assert said(caplog)[0] == "rank 1 failed first: exit code 1"
