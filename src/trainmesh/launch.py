"""Launching: turn `trainmesh run` options into torchrun's and hand off to its elastic agent.

We never manage processes ourselves: torch.distributed.run starts one worker per rank, watches them,
restarts the group up to `--max-restarts` times, and reports the failed rank. What we add are
defaults: a free port on loopback for single-node runs, `auto` process counts, every rank's output kept in
the run folder (core/rank_logs.py), and a config that has been validated for the planned world size before
any process starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
from torch.distributed import DistError
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import elastic_launch

from trainmesh.core.dist import is_loopback, loopback_store
from trainmesh.core.env import free_port
from trainmesh.core.errors import EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_STALLED, EXIT_USER_ERROR, UserError
from trainmesh.core.exit_records import ExitRecord, read_records, records_folder
from trainmesh.core.logging import get_logger
from trainmesh.core.rank_logs import NO_LOG_DIR, PREFIX, STDERR, LogSettings, RankLogs, claim_launch_folder, tail
from trainmesh.core.signals import signals_held

log = get_logger(__name__)


EXIT_MEANINGS = {
    EXIT_USER_ERROR: "a problem with the config, the inputs or the run folder (its message, above, says what to fix)",
    EXIT_PREEMPTED: "stopped by SIGTERM (preemption) after saving a checkpoint",
    EXIT_INTERRUPTED: "stopped by Ctrl-C",
    EXIT_STALLED: "stall watchdog: no step within dist.stall_timeout_s; see <run>/stalls/ for the report and stacks",
}


class LaunchError(UserError, ValueError):
    """Launcher options that cannot work; the message says which flag to change."""


@dataclass
class LaunchOptions:
    nproc_per_node: str = "auto"
    """Processes per node: a number, or auto (all GPUs, else 2 CPU processes)."""
    nnodes: str = "1"
    """Number of nodes, or MIN:MAX for elastic membership (c10d rendezvous)."""
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    join_timeout_s: int = 300
    """How long the nodes may take to meet (rendezvous) before the launch fails."""
    shutdown_timeout_s: int | None = None
    """torchrun's --shutdown-timeout: how long the agent, once signalled, waits for the workers to stop (save a
    checkpoint) before it SIGKILLs them. None: torchrun's default (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)."""
    rdzv_conf: str | None = None
    """More c10d rendezvous settings, KEY=VALUE[,KEY=VALUE] (torchrun's --rdzv-conf), e.g. last_call_timeout=5."""
    standalone: bool = False
    """torchrun's --standalone: one node meeting on loopback at a free port (trainmesh's default anyway)."""
    logs: LogSettings = field(default_factory=LogSettings)
    """Where each rank's stdout and stderr go (--log-dir, --redirects, --tee, --local-ranks-filter)."""

    def nproc(self) -> int:
        if self.nproc_per_node == "auto":
            return torch.cuda.device_count() if torch.cuda.is_available() else 2
        try:
            n = int(self.nproc_per_node)
        except ValueError:
            raise LaunchError(f"--nproc-per-node={self.nproc_per_node!r}: expected a number or 'auto'") from None
        if n < 1:
            raise LaunchError(f"--nproc-per-node={n}: must be at least 1")
        return n

    def node_bounds(self) -> tuple[int, int]:
        low, _, high = self.nnodes.partition(":")
        try:
            bounds = int(low), int(high or low)
        except ValueError:
            raise LaunchError(f"--nnodes={self.nnodes!r}: expected N or MIN:MAX (e.g. 2 or 1:4)") from None
        if not 1 <= bounds[0] <= bounds[1]:
            raise LaunchError(f"--nnodes={self.nnodes!r}: need 1 <= MIN <= MAX")
        return bounds

    def world_sizes(self) -> list[int]:
        """Every world size this launch may run at (one, unless the node count is elastic)."""
        low, high = self.node_bounds()
        return [n * self.nproc() for n in range(low, high + 1)]

    @property
    def multi_node(self) -> bool:
        return self.node_bounds()[1] > 1

    def default_run_suffix(self) -> str | None:
        """Nodes must agree on the run directory; derive it from what they already share."""
        if not self.multi_node:
            return None
        return self.rendezvous_id() or f"{self.master_addr}-{self.master_port}".replace(".", "-")

    def check(self) -> None:
        """Refuse options that cannot launch, naming the flag; before anything is started or written."""
        self.nproc()
        self.node_bounds()
        if self.standalone and (self.multi_node or self.rdzv_endpoint or self.master_addr):
            raise LaunchError(
                f"--standalone is for one node, but --nnodes={self.nnodes}"
                f"{', --rdzv-endpoint' if self.rdzv_endpoint else ''}{', --master-addr' if self.master_addr else ''} "
                "ask for a rendezvous between nodes. Fix: drop --standalone (or the multi-node flags)."
            )
        if self.join_timeout_s < 1:
            raise LaunchError(f"--join-timeout={self.join_timeout_s}: must be at least 1 (seconds)")
        if self.shutdown_timeout_s is not None and self.shutdown_timeout_s < 1:
            raise LaunchError(f"--shutdown-timeout={self.shutdown_timeout_s}: must be at least 1 (seconds)")
        try:
            self.logs.check(self.nproc())
        except ValueError as e:
            raise LaunchError(str(e)) from None
        if self.rdzv_endpoint:
            host, _, port = self.rdzv_endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise LaunchError(f"--rdzv-endpoint={self.rdzv_endpoint!r}: expected HOST:PORT")
            check_resolvable(host, "--rdzv-endpoint", self.dns_wait_s())
            _rdzv_conf(self.rdzv_conf)
        elif self.rdzv_conf:
            raise LaunchError(f"--rdzv-conf={self.rdzv_conf!r} needs --rdzv-endpoint HOST:PORT (c10d rendezvous)")
        elif self.multi_node:
            if not self.master_addr or not self.master_port:
                # A PyTorchJob with a Master replica: the operator sets MASTER_ADDR/MASTER_PORT, not torchrun's
                # PET_MASTER_ADDR/PET_MASTER_PORT (training-operator's envvar.go), so they are passed by hand.
                kubeflow = "PET_NNODES" in os.environ and "MASTER_ADDR" in os.environ
                raise LaunchError(
                    f"--nnodes={self.nnodes} needs --master-addr and --master-port (static rendezvous: every node "
                    "passes the same address of node 0 and its own --node-rank) or --rdzv-endpoint HOST:PORT."
                    + (
                        " In a Kubeflow PyTorchJob with a Master: add --master-addr $(MASTER_ADDR) --master-port "
                        "$(MASTER_PORT) to the container's command."
                        if kubeflow
                        else ""
                    )
                )
            if ":" in self.nnodes:
                raise LaunchError(
                    f"--nnodes={self.nnodes} (elastic) needs --rdzv-endpoint HOST:PORT, not --master-addr"
                )
            check_resolvable(self.master_addr, "--master-addr", self.dns_wait_s())

    def dns_wait_s(self) -> float:
        """How long a host name may take to resolve: in a Kubernetes pod, the other pods' names (a headless
        service's records) appear only as those pods start, so up to --join-timeout; elsewhere a name that does
        not resolve is a mistake, refused at once."""
        return float(self.join_timeout_s) if IN_KUBERNETES in os.environ else 0.0

    def rendezvous_id(self) -> str | None:
        """The c10d job id: given, or derived from the endpoint every node was told (so they agree)."""
        if not self.rdzv_endpoint:
            return None
        return self.rdzv_id or "tm-" + self.rdzv_endpoint.replace(".", "-").replace(":", "-")


def torchrun_argv(opts: LaunchOptions, entry: list[str], module: bool, log_folder: Path | None = None) -> list[str]:
    """The torchrun command line for `entry` (a module and its args when `module`, else a script); `log_folder`:
    this launch's folder of per-rank logs (launch() claims it when opts.logs keeps them)."""
    opts.check()
    argv = [f"--nproc-per-node={opts.nproc()}", f"--nnodes={opts.nnodes}", f"--max-restarts={opts.max_restarts}"]
    argv += [f"--shutdown-timeout={opts.shutdown_timeout_s}"] if opts.shutdown_timeout_s is not None else []
    given = opts.logs if log_folder else dataclasses.replace(opts.logs, log_dir=NO_LOG_DIR)  # no folder: torchrun's
    redirects, tee, shown = given.torchrun_flags()
    argv += [f"--log-dir={log_folder}"] if log_folder else []
    argv += [f"--redirects={redirects}"] if redirects != "0" else []
    argv += [f"--tee={tee}"] if tee != "0" else []
    argv += [f"--local-ranks-filter={shown}"] if shown else []
    if opts.rdzv_endpoint:
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--rdzv-id={opts.rendezvous_id()}",
            f"--rdzv-conf={','.join([f'join_timeout={opts.join_timeout_s}', *_rdzv_conf(opts.rdzv_conf)])}",
        ]
        if is_loopback(opts.rdzv_endpoint.rpartition(":")[0]):
            argv.append("--local-addr=127.0.0.1")  # workers then meet on loopback too
    elif opts.multi_node:
        argv += [
            f"--node-rank={opts.node_rank}",
            f"--master-addr={opts.master_addr}",
            f"--master-port={opts.master_port}",
            f"--rdzv-conf=timeout={opts.join_timeout_s}",
        ]
    else:
        # Single node: the store listens on loopback, on a port nobody else is using.
        addr = opts.master_addr or "127.0.0.1"
        argv += ["--node-rank=0", f"--master-addr={addr}", f"--master-port={opts.master_port or free_port()}"]
    if module:
        argv.append("-m")
    return argv + entry


def _rdzv_conf(conf: str | None) -> list[str]:
    """--rdzv-conf's KEY=VALUE items, checked (join_timeout has a flag of its own)."""
    items = [item.strip() for item in (conf or "").split(",") if item.strip()]
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key or not value:
            raise LaunchError(f"--rdzv-conf={conf!r}: expected KEY=VALUE[,KEY=VALUE] (e.g. last_call_timeout=5)")
        if key == "join_timeout":
            raise LaunchError(f"--rdzv-conf={conf!r}: set the join timeout with --join-timeout")
    return items


DNS_RETRY_S = 2.0
IN_KUBERNETES = "KUBERNETES_SERVICE_HOST"
"""Set in every pod: there, the names of the job's other pods resolve only once those pods run."""


def check_resolvable(host: str, flag: str, wait_s: float = 0.0) -> None:
    """Refuse a host name that does not resolve, after trying for `wait_s` seconds. A stop signal ends the wait
    (a container's PID 1 would otherwise ignore SIGTERM, and its pod linger until SIGKILLed)."""
    deadline = time.monotonic() + wait_s
    next_note = time.monotonic()
    with signals_held() as stops:
        while not stops:
            try:
                socket.getaddrinfo(host, None)
                return
            except socket.gaierror as e:
                error = e
            now = time.monotonic()
            if now >= deadline:
                tried = f" for {wait_s:.0f} s (--join-timeout)" if wait_s else ""
                raise LaunchError(
                    f"{flag}={host!r} does not resolve ({error.strerror}){tried}. Check the host name or use an IP."
                )
            if now >= next_note:
                log.info(
                    "%s=%s does not resolve yet (%s): its pod may not be running yet; trying again for %.0f s more "
                    "(--join-timeout)",
                    flag,
                    host,
                    error.strerror,
                    deadline - now,
                )
                next_note = now + 30
            time.sleep(min(DNS_RETRY_S, deadline - now))
        name = signal.Signals(stops[0]).name
        stops.clear()  # stopped here: nothing was started
    raise LaunchError(f"stopped by {name} while waiting for {flag}={host!r} to resolve; nothing was started")


def launch(opts: LaunchOptions, entry: list[str], module: bool, run_id: str | None = None) -> int:
    """Run `entry` on every rank through torch's elastic agent; returns the exit code for the CLI.
    `run_id`: the run's id, for the command that continues it after a stop."""
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
                return _report_stop(signal.Signals(e.sigval), read_records(records) if run_id else None, opts, run_id)
    except SignalException as e:  # another, while the first was reported (torch's handlers are still in place)
        log.error("stopped by %s", signal.Signals(e.sigval).name)
        return 128 + int(e.sigval)
    except (DistError, RendezvousError) as e:  # the nodes could not meet: say what to check
        log.error("%s", explain_rendezvous_failure(e, opts))
        return 1
    except ChildFailedError as e:
        return _report_failure(e, logs)
    return 0


STOP_CODES = {signal.SIGTERM: EXIT_PREEMPTED, signal.SIGINT: EXIT_INTERRUPTED}
"""What a worker exits with when it stopped at a step boundary, with a checkpoint, on that signal."""


def _report_stop(
    sig: signal.Signals, records: dict[int, ExitRecord] | None, opts: LaunchOptions, run_id: str | None
) -> int:
    """The exit code after the agent was signalled and shut its workers down. `records`: by local rank, how
    trainmesh's workers said they ended (None: the entry is a script, whose exit codes are its own). A stop with
    a checkpoint (75 after SIGTERM, 130 after Ctrl-C) is claimed only when every rank on this node recorded one;
    else 128 + the signal's number, as for a process the signal ended."""
    stopped = STOP_CODES.get(sig)
    name = "Ctrl-C" if sig == signal.SIGINT else sig.name
    if stopped is None or records is None:
        log.error("stopped by %s (forwarded to the ranks, which had --shutdown-timeout to end)", name)
        return 128 + int(sig)
    again = f"--resume --run-id {run_id}"
    ranks = range(opts.nproc())
    if records.keys() == set(ranks):
        # The ranks agree on one stop code (Ctrl-C on any node wins over SIGTERM): either shows a checkpoint.
        if all(record.stopped_with_checkpoint for record in records.values()):
            log.warning("%s: every rank stopped at a step boundary with a checkpoint. Continue with: %s", name, again)
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
    log.error(
        "%s: not every rank stopped with a checkpoint; %s continues from the newest committed checkpoint, if any",
        name,
        again,
    )
    return 128 + int(sig)  # not the stop code: a scheduler requeues on that one


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
    """torchrun's `run(parse_args(argv))`, with the layout of core/rank_logs.py when the logs are kept."""
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


def _report_failure(error: ChildFailedError, logs: RankLogs | None) -> int:
    """Name the rank that failed first (by time: the root cause; the others often follow from it), its error and
    its log file, then the ranks that followed; the exit code for the CLI."""
    first_rank, first = error.get_first_failure()
    log.error("rank %d failed first: %s%s", first_rank, _describe(first.exitcode, first.signal_name()), _log_of(first))
    message: object = first.message  # the error file's text, or its nested {"message": ...} record
    if isinstance(message, dict):
        message = message.get("message", "")
    if message and first.exitcode != EXIT_USER_ERROR:  # a user error's message is in the rank's log
        log.error("rank %d error: %s", first_rank, message)
    stderr = Path(first.error_file).parent / STDERR
    if logs is not None and not logs.shown(first.local_rank) and stderr.is_file():  # the console did not show it
        log.error("the end of rank %d's %s:\n%s", first_rank, stderr, textwrap.indent(tail(stderr), "  | "))
    for rank, failure in sorted(error.failures.items()):
        if rank != first_rank:
            log.error("rank %d then: %s%s", rank, _describe(failure.exitcode, failure.signal_name()), _log_of(failure))
    return EXIT_USER_ERROR if first.exitcode == EXIT_USER_ERROR else 1


def _log_of(failure: ProcessFailure) -> str:
    """The text that names a failed rank's stderr file, when it was kept (next to the rank's error file)."""
    stderr = Path(failure.error_file).parent / STDERR
    return f"; its output: {stderr}" if failure.error_file and stderr.is_file() else ""


# With the c10d rendezvous, torch's agents by default share their store with the workers. Then a node
# that joins a later round (a replacement) never starts: with torch 2.13 an agent that stays rank 0
# across rounds publishes MASTER_ADDR/MASTER_PORT into the round's store only in its first round
# (DynamicRendezvousHandler.next_rendezvous caches it), while the new node waits for them in the new
# round's keys until the store times out. Not shared, rank 0 publishes them every round, and its worker
# 0 hosts a new store for each round (core.dist.attempt_store).
NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


@contextlib.contextmanager
def _agent_environment(opts: LaunchOptions) -> Iterator[None]:
    """The environment torchrun's agent runs in (and passes on to the workers); a value already set wins."""
    if not opts.rdzv_endpoint or NO_SHARED_STORE in os.environ:
        yield
        return
    os.environ[NO_SHARED_STORE] = "1"
    try:
        yield
    finally:
        os.environ.pop(NO_SHARED_STORE, None)


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


def _describe(exitcode: int, signal_name: str) -> str:
    if exitcode < 0:
        return f"killed by signal {signal_name} ({exitcode})"
    if exitcode in EXIT_MEANINGS:
        return f"exit code {exitcode}: {EXIT_MEANINGS[exitcode]}"
    return f"exit code {exitcode}"
