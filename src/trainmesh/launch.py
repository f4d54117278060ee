"""Launching: turn `trainmesh run` options into torchrun's and hand off to its elastic agent.

We never manage processes ourselves: torch.distributed.run starts one worker per rank, watches them,
restarts the group up to `--max-restarts` times, and reports the failed rank. What we add are
defaults: a free port on loopback for single-node runs, `auto` process counts, and a config that has
been validated for the planned world size before any process starts.
"""

from __future__ import annotations

import ipaddress
import signal
import socket
from dataclasses import dataclass

import torch
from torch.distributed import run as torchrun
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from trainmesh.runtime.env import free_port
from trainmesh.runtime.logging import get_logger
from trainmesh.train.preemption import EXIT_PREEMPTED

log = get_logger(__name__)


class LaunchError(ValueError):
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

    def rendezvous_id(self) -> str | None:
        """The c10d job id: given, or derived from the endpoint every node was told (so they agree)."""
        if not self.rdzv_endpoint:
            return None
        return self.rdzv_id or "tm-" + self.rdzv_endpoint.replace(".", "-").replace(":", "-")


def torchrun_argv(opts: LaunchOptions, entry: list[str], module: bool) -> list[str]:
    """The torchrun command line for `entry` (a module and its args when `module`, else a script)."""
    nproc = opts.nproc()
    opts.node_bounds()  # validates --nnodes
    argv = [f"--nproc-per-node={nproc}", f"--nnodes={opts.nnodes}", f"--max-restarts={opts.max_restarts}"]
    if opts.rdzv_endpoint:
        host, _, port = opts.rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit():
            raise LaunchError(f"--rdzv-endpoint={opts.rdzv_endpoint!r}: expected HOST:PORT")
        check_resolvable(host, "--rdzv-endpoint")
        argv += [
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={opts.rdzv_endpoint}",
            f"--rdzv-id={opts.rendezvous_id()}",
        ]
        if _is_loopback(host):
            argv.append("--local-addr=127.0.0.1")  # workers then meet on loopback too
    elif opts.multi_node:
        if not opts.master_addr or not opts.master_port:
            raise LaunchError(
                f"--nnodes={opts.nnodes} needs --master-addr and --master-port (static rendezvous: every node "
                "passes the same address of node 0 and its own --node-rank) or --rdzv-endpoint HOST:PORT."
            )
        if ":" in opts.nnodes:
            raise LaunchError(f"--nnodes={opts.nnodes} (elastic) needs --rdzv-endpoint HOST:PORT, not --master-addr")
        check_resolvable(opts.master_addr, "--master-addr")
        argv += [
            f"--node-rank={opts.node_rank}",
            f"--master-addr={opts.master_addr}",
            f"--master-port={opts.master_port}",
        ]
    else:
        # Single node: the store listens on loopback, on a port nobody else is using.
        addr = opts.master_addr or "127.0.0.1"
        argv += ["--node-rank=0", f"--master-addr={addr}", f"--master-port={opts.master_port or free_port()}"]
    if module:
        argv.append("-m")
    return argv + entry


def check_resolvable(host: str, flag: str) -> None:
    try:
        socket.getaddrinfo(host, None)
    except socket.gaierror as e:
        raise LaunchError(
            f"{flag}={host!r} does not resolve ({e.strerror}). Check the host name or use an IP."
        ) from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def launch(opts: LaunchOptions, entry: list[str], module: bool) -> int:
    """Run `entry` on every rank through torch's elastic agent; returns the exit code for the CLI."""
    argv = torchrun_argv(opts, entry, module)
    log.info("torchrun %s", " ".join(argv))
    try:
        torchrun.run(torchrun.parse_args(argv))
    except SignalException as e:  # the agent forwarded it to the workers and waited for them
        if e.sigval == signal.SIGTERM:
            log.warning("SIGTERM: the workers stopped at a step boundary with a checkpoint; relaunch with --resume")
            return EXIT_PREEMPTED
        log.error("stopped by %s", signal.Signals(e.sigval).name)
        return 128 + int(e.sigval)
    except ChildFailedError as e:
        first_rank, first = e.get_first_failure()  # by time: the root cause; the others often follow from it
        log.error("rank %d failed first: %s", first_rank, _describe(first.exitcode, first.signal_name()))
        message: object = first.message  # the error file's text, or its nested {"message": ...} record
        if isinstance(message, dict):
            message = message.get("message", "")
        if message:
            log.error("rank %d error: %s", first_rank, message)
        for rank, failure in sorted(e.failures.items()):
            if rank != first_rank:
                log.error("rank %d then: %s", rank, _describe(failure.exitcode, failure.signal_name()))
        return 1
    return 0


def _describe(exitcode: int, signal_name: str) -> str:
    if exitcode < 0:
        return f"killed by signal {signal_name} ({exitcode})"
    return f"exit code {exitcode}"
