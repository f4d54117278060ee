"""Errors the user can fix and the exit codes trainmesh's processes end with. A `UserError` says what was given, what is
allowed and how to fix it; it prints as one line per rank, without a traceback, and exits `EXIT_USER_ERROR`. Anything
else keeps its traceback."""

from __future__ import annotations

EXIT_USER_ERROR = 2  # as argparse: the command, its config or its inputs need fixing
EXIT_PREEMPTED = 75  # EX_TEMPFAIL, "try again later": stopped by SIGTERM after saving a checkpoint
EXIT_STALLED = 76  # the stall watchdog ended a hung attempt
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by Ctrl-C (after saving a checkpoint, once training ran)
EXIT_TERMINATED = 143
"""128 + SIGTERM: stopped without the promise of EXIT_PREEMPTED: a command with nothing to save (data prepare),
its temporary files removed; or a launch whose ranks did not all stop with a checkpoint."""


class UserError(Exception):
    """A problem with what the user asked for or gave (config, inputs, run folder); shown without a traceback."""
