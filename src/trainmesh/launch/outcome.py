"""How a launch ended, told to the user: the rank that failed first and its log, whether a stop was one with
a checkpoint on every rank, and what a failed rendezvous means; each gives the CLI's exit code."""

from __future__ import annotations

import signal
import textwrap
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_STALLED, EXIT_USER_ERROR
from trainmesh.core.logging import get_logger
from trainmesh.launch.exit_records import ExitRecord
from trainmesh.launch.options import LaunchOptions
from trainmesh.launch.rank_logs import STDERR, RankLogs, tail

log = get_logger(__name__)


EXIT_MEANINGS = {
    EXIT_USER_ERROR: "a problem with the config, the inputs or the run folder (its message, above, says what to fix)",
    EXIT_PREEMPTED: "stopped by SIGTERM (preemption) after saving a checkpoint",
    EXIT_INTERRUPTED: "stopped by Ctrl-C",
    EXIT_STALLED: "stall watchdog: no step within dist.stall_timeout_s; see <run>/stalls/ for the report and stacks",
}
"""What the exit codes of trainmesh's own workers mean. A script's exit codes are its own (argparse's 2 is a bad
command line, not a trainmesh config), so they are reported as plain numbers."""


_NOTICED_LATE_S = 1
"""How much later than it died a rank killed by a signal may be dated: torch's agent notices it within its monitor
interval (a fraction of a second) and dates it then, in whole seconds."""
_CRASHES = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGKILL})
"""Signals a rank dies of on its own (a fault, or the kernel's out-of-memory killer). Not SIGABRT: NCCL's watchdog
aborts a rank within a second of a peer's exception, so an abort is as often the consequence as the cause."""


STOP_CODES = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}
"""What a worker exits with when it stopped at a step boundary, with a checkpoint, on that signal."""


def explain_stop(
    sig: signal.Signals, records: dict[int, ExitRecord] | None, opts: LaunchOptions, resume_hint: str | None
) -> int:
    """The exit code after the agent was signalled and shut its workers down. `records`: by local rank, how
    trainmesh's workers said they ended (None: the entry is a script, whose exit codes are its own). A stop with
    a checkpoint (75 after SIGTERM, 130 after Ctrl-C) is claimed only when every rank on this node recorded one;
    else 128 + the signal's number, as for a process the signal ended. `resume_hint`: the command that continues
    the run (None: the launch is not one to continue)."""
    stopped = STOP_CODES.get(sig)
    name = "Ctrl-C" if sig == signal.SIGINT else sig.name
    if stopped is None or records is None:
        log.error("stopped by %s (forwarded to the ranks, which had --shutdown-timeout to end)", name)
        return 128 + int(sig)
    ranks = range(opts.nproc())
    if records.keys() == set(ranks):
        # The ranks agree on one stop code (Ctrl-C on any node wins over SIGTERM): either shows a checkpoint.
        if all(record.stopped_with_checkpoint for record in records.values()):
            again = f" Continue with: {resume_hint}" if resume_hint else ""
            log.warning("%s: every rank stopped at a step boundary with a checkpoint.%s", name, again)
            return stopped
        if all(record.exit_code == 0 for record in records.values()):  # they had finished as the signal came
            log.warning("%s after every rank had finished", name)
            return 0
    for local_rank in ranks:
        record = records.get(local_rank)
        rank = f"local rank {local_rank}" if record is None or record.rank is None else f"rank {record.rank}"
        if record is None:
            log.error("%s: %s had not started, or could not record that it had", name, rank)
        elif record.exit_code is None:
            log.error(
                "%s: %s did not stop with a checkpoint: it recorded no exit code. Killed by the signal before it "
                "could stop at a step boundary (still starting), or after the agent's --shutdown-timeout; or it "
                "crashed (its log says)",
                name,
                rank,
            )
        elif not record.stopped_with_checkpoint:
            log.error("%s: %s did not stop with a checkpoint: %s", name, rank, _describe(record.exit_code, ""))
    again = f"; {resume_hint} continues from the newest committed checkpoint, if any" if resume_hint else ""
    log.error("%s: not every rank stopped with a checkpoint%s", name, again)
    return 128 + int(sig)  # not the stop code: a scheduler requeues on that one


def explain_failure(error: ChildFailedError, logs: RankLogs | None, worker: bool) -> int:
    """Name the rank that failed first (`first_failure`: the root cause; the others often follow from it), its error
    and its log file, then the ranks that followed; the exit code for the CLI. `worker`: the ranks ran trainmesh's
    worker, whose exit codes mean what EXIT_MEANINGS says; a script's are its own. So the CLI exits 2 (fix the
    config or inputs) only when trainmesh's worker said so, and 1 for any other failed rank."""
    first_rank, first = first_failure(error)
    user_error = worker and first.exitcode == EXIT_USER_ERROR
    described = _describe(first.exitcode, first.signal_name(), worker)
    log.error("rank %d failed first: %s%s", first_rank, described, _log_of(first))
    message: object = first.message  # the error file's text, or its nested {"message": ...} record
    if isinstance(message, dict):
        message = message.get("message", "")
    if str(message).startswith("To enable traceback see"):  # torch's text for a rank that wrote no error file
        message = ""
    if message and not user_error:  # a user error's message is in the rank's log
        log.error("rank %d error: %s", first_rank, message)
    stderr = Path(first.error_file).parent / STDERR
    if logs is not None and not logs.shown(first.local_rank) and stderr.is_file():  # the console did not show it
        log.error("the end of rank %d's %s:\n%s", first_rank, stderr, textwrap.indent(tail(stderr), "  | "))
    for rank, failure in sorted(error.failures.items()):
        if rank != first_rank:
            described = _describe(failure.exitcode, failure.signal_name(), worker)
            log.error("rank %d then: %s%s", rank, described, _log_of(failure))
    return EXIT_USER_ERROR if user_error else 1


def first_failure(error: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed first, and its failure. Failures are dated in whole seconds: one with an error file (an
    exception) when it was written, one without (a signal) when the agent noticed it, so a crash can be dated after
    the peer it broke. Seen with trainmesh's workers after a peer's segfault: the peer's collective raises at once
    ("Connection closed by peer") and it ends with exit code 1 and an error file, or, when the agent's SIGTERM
    comes after that exception has left the loop (and its SIGTERM handler), killed by SIGTERM (-15); never 75 or
    143, which need every rank alive to agree on a stop. So a rank ended by SIGTERM, how torch's agent stops the
    ranks still running, comes after every other; a rank that crashed (`_CRASHES`) counts as dated a second early
    (`_NOTICED_LATE_S`) and, at the same date, comes before an exit code, which comes before another signal."""
    failures = error.failures

    def order(rank: int) -> tuple[bool, int, int]:
        failure = failures[rank]
        stopped = failure.exitcode == -signal.SIGTERM
        crashed = -failure.exitcode in _CRASHES
        at_same_date = 0 if crashed else 1 if failure.exitcode > 0 else 2  # then an exit code, then other signals
        return stopped, failure.timestamp - (_NOTICED_LATE_S if crashed else 0), at_same_date

    rank = min(failures, key=order)
    return rank, failures[rank]


def _log_of(failure: ProcessFailure) -> str:
    """The text that names a failed rank's stderr file, when it was kept (next to the rank's error file)."""
    stderr = Path(failure.error_file).parent / STDERR
    return f"; its output: {stderr}" if failure.error_file and stderr.is_file() else ""


def explain_rendezvous_failure(error: Exception, opts: LaunchOptions) -> str:
    """torchrun's rendezvous error, turned into what happened and what to check."""
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    where = opts.rdzv_endpoint or f"{opts.master_addr or '127.0.0.1'}:{opts.master_port}"
    waited = f"--join-timeout={opts.join_timeout_s} s"
    same_flags = f"every node runs this command with --nnodes {opts.nnodes} and the same " + (
        "--rdzv-endpoint" if opts.rdzv_endpoint else "--master-addr/--master-port, each with its own --node-rank"
    )
    if "EADDRINUSE" in first_line or "address already in use" in first_line.lower():
        fix = "choose another --master-port" + ("" if opts.multi_node else ", or leave it out to get a free one")
        return f"port {where} is already in use (another run, or another program). Fix: {fix}. [{first_line}]"
    if "waiting for clients" in first_line or "RendezvousTimeout" in type(error).__name__:
        return (
            f"the nodes did not all join at {where} within {waited}: {first_line}\n"
            f"Check that {same_flags}; that they can reach {where}; raise --join-timeout when nodes start late."
        )
    if "connect" in first_line.lower():
        return (
            f"nothing answered at {where} within {waited}: {first_line}\n"
            f"Check that node 0 is running (with --node-rank 0), that {where} is its address "
            f"as seen from this node, that no firewall blocks the port, and that {same_flags}."
        )
    return f"the rendezvous at {where} failed: {first_line}\nCheck that {same_flags}."


def _describe(exitcode: int, signal_name: str, worker: bool = True) -> str:
    """A rank's end in words; `worker`: it ran trainmesh's worker, so its exit code means what EXIT_MEANINGS says."""
    if exitcode < 0:
        return f"killed by signal {signal_name} ({exitcode})"
    if worker and exitcode in EXIT_MEANINGS:
        return f"exit code {exitcode}: {EXIT_MEANINGS[exitcode]}"
    return f"exit code {exitcode}"
