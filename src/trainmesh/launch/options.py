"""`trainmesh run`'s launch options (torchrun's flags), checked before anything starts, and the torchrun
command line they make."""

from __future__ import annotations

import dataclasses
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainmesh.core.dist import is_loopback
from trainmesh.core.env import free_port, var_is_set
from trainmesh.core.errors import UserError
from trainmesh.core.logging import get_logger
from trainmesh.core.signals import signals_held
from trainmesh.launch.rank_logs import NO_LOG_DIR, LogSettings

log = get_logger(__name__)


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
                kubeflow = var_is_set("PET_NNODES") and var_is_set("MASTER_ADDR")
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
        return float(self.join_timeout_s) if var_is_set(IN_KUBERNETES) else 0.0

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
