"""Launching: turn `trainmesh run` options into torchrun's and hand off to its elastic agent, which starts, watches and
restarts the workers; trainmesh adds defaults and rank logs.

Details: docs/internals.md#launch__init__py
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

from torch.distributed import DistError
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from trainmesh.core.dist import is_loopback, loopback_store
from trainmesh.core.env import vars_set
from trainmesh.core.logging import get_logger
from trainmesh.core.orphans import LAUNCHER_PID
from trainmesh.launch.exit_records import read_records, records_folder
from trainmesh.launch.options import LaunchError, LaunchOptions, torchrun_argv
from trainmesh.launch.outcome import explain_failure, explain_rendezvous_failure, explain_stop
from trainmesh.launch.rank_logs import PREFIX, RankLogs, claim_launch_folder

__all__ = ["NO_SHARED_STORE", "LaunchError", "LaunchOptions", "launch", "torchrun_argv"]

log = get_logger(__name__)


def launch(
    opts: LaunchOptions, entry: list[str], module: bool, run_id: str | None = None, resume_hint: str | None = None
) -> int:
    """Run `entry` on every rank through torch's elastic agent; returns the exit code for the CLI.
    `run_id`: given when `entry` is trainmesh's worker (a recipe's run), which records how each rank ended
    (launch/exit_records.py). `resume_hint`: the command that continues the run after a stop (None: no such hint)."""
    store = None  # single node: the agent's store, on loopback only, kept alive while the agent runs
    if not opts.multi_node and not opts.rdzv_endpoint and is_loopback(opts.master_addr or "127.0.0.1"):
        try:
            store = loopback_store(opts.master_port or 0, timedelta(seconds=opts.join_timeout_s))
        except OSError as e:
            raise LaunchError(
                f"--master-port={opts.master_port}: {e.strerror}. Fix: choose another port, or leave "
                "--master-port out to get a free one."
            ) from None
        opts = dataclasses.replace(opts, master_addr="127.0.0.1", master_port=store.port)
    logs = _claim_logs(opts)
    argv = torchrun_argv(opts, entry, module, logs.folder if logs else None)
    log.info("torchrun %s", " ".join(argv))
    if logs:
        shown = opts.logs.torchrun_flags()[2]
        log.info(
            "each rank's stdout and stderr: %s/attempt_<n>/rank_<r>/ (on the console: %s)",
            logs.folder,
            f"local rank {shown}" if shown else "every rank",
        )
    try:
        with _agent_environment(opts), records_folder() as records:
            try:
                _run_agent(argv, logs)
            except SignalException as e:  # the agent forwarded it to the workers and waited for them
                return explain_stop(
                    signal.Signals(e.sigval), read_records(records) if run_id else None, opts, resume_hint
                )
    except SignalException as e:  # another, while the first was reported (torch's handlers are still in place)
        log.error("stopped by %s", signal.Signals(e.sigval).name)
        return 128 + int(e.sigval)
    except (DistError, RendezvousError) as e:  # the nodes could not meet: say what to check
        log.error("%s", explain_rendezvous_failure(e, opts))
        return 1
    except ChildFailedError as e:
        return explain_failure(e, logs, worker=run_id is not None)
    return 0


def _claim_logs(opts: LaunchOptions) -> RankLogs | None:
    """This launch's per-rank log files (a new folder under --log-dir), or None when they are not kept (or no
    folder was named: launch_into names <run>/logs)."""
    if not opts.logs.kept or opts.logs.log_dir is None:
        return None
    try:
        folder = claim_launch_folder(Path(opts.logs.log_dir), opts.multi_node)
    except OSError as e:
        raise LaunchError(
            f"--log-dir={opts.logs.log_dir}: cannot create this launch's log folder there: {e.strerror or e}. Fix: a "
            "folder you can write to, or --log-dir none to keep no log files."
        ) from None
    return opts.logs.specs(folder)


def _run_agent(argv: list[str], logs: RankLogs | None) -> None:
    """torchrun's `run(parse_args(argv))`, with the layout of launch/rank_logs.py when the logs are kept."""
    args = torchrun.parse_args(argv)
    if logs is None:
        torchrun.run(args)
        return
    # Before building the launch config, run() fills in --standalone and a static rendezvous without a port;
    # neither occurs here: torchrun_argv always names the master port or the c10d endpoint.
    assert not args.standalone and (args.rdzv_endpoint or args.master_port is not None), argv
    config, entrypoint, entry_args = torchrun.config_from_args(args)
    config.logs_specs = logs
    if config.log_line_prefix_template is None:  # TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, if set, wins
        config.log_line_prefix_template = PREFIX
    elastic_launch(config, entrypoint)(*entry_args)


# With the c10d rendezvous, torch's agents by default share their store with the workers. Then a node
# that joins a later round (a replacement) never starts: with torch 2.13 an agent that stays rank 0
# across rounds publishes MASTER_ADDR/MASTER_PORT into the round's store only in its first round
# (DynamicRendezvousHandler.next_rendezvous caches it), while the new node waits for them in the new
# round's keys until the store times out. Not shared, rank 0 publishes them every round, and its worker
# 0 hosts a new store for each round (core.dist.attempt_store).
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _agent_environment(opts: LaunchOptions) -> Iterator[None]:
    """The environment torchrun's agent runs in (and passes on to the workers): its own pid, which each worker
    watches (core/orphans.py), and NO_SHARED_STORE for the c10d rendezvous (a value already set wins)."""
    values = {LAUNCHER_PID: str(os.getpid())}
    with vars_set(values, defaults={NO_SHARED_STORE: "1"} if opts.rdzv_endpoint else None):
        yield
