"""`trainmesh horovodrun`: horovodrun's command line mapped onto `trainmesh run`'s launch. One host (this one) maps
directly; several hosts, and flags without a counterpart, are refused with what to do instead.

Details: docs/internals.md#compathorovodrunpy
"""

from __future__ import annotations

import re
import shlex
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from trainmesh.core.env import DEFAULT_MASTER_PORT
from trainmesh.core.errors import UserError

if TYPE_CHECKING:
    from trainmesh.launch import LaunchOptions

USAGE = """usage: trainmesh horovodrun -np N [-H HOST:SLOTS[,HOST:SLOTS...] | --hostfile FILE] [--start-timeout S]
                            [--gloo] [--verbose] [python [-u]] script.py [args...] | python -m module [args...]

horovodrun's command line on trainmesh run's launcher (torchrun): a Horovod script that imports trainmesh.horovod
as hvd runs unchanged. One host (none given, or this one) is launched here; several hosts are refused with
the trainmesh run command to start on each (trainmesh does not ssh into other machines).

  -np, --num-proc N       processes in all (trainmesh run --nproc-per-node N)
  -H, --hosts LIST        HOST:SLOTS,... (horovodrun fills the hosts in order, as here)
  --hostfile FILE         lines 'HOST slots=N' (or HOST:N), instead of -H
  --start-timeout S       seconds the processes may take to meet (trainmesh run --join-timeout S)
  --gloo                  accepted: torch.distributed uses gloo on CPU, NCCL on GPUs anyway
  --verbose               accepted: launch details are logged

More, and the Horovod API that is supported: docs/horovod.md."""

SUPPORTED = "-np/--num-proc, -H/--hosts, --hostfile, --start-timeout, --gloo, --verbose, -h/--help"
VALUE_FLAGS = {"-np": "np", "--num-proc": "np", "-H": "hosts", "--hosts": "hosts", "--hostfile": "hostfile"}
VALUE_FLAGS |= {"--start-timeout": "start_timeout"}
ACCEPTED = {"--gloo", "--verbose"}

# horovodrun's other flags, by why there is no counterpart and what to do instead.
_REFUSED_GROUPS = {
    "trainmesh launches with torchrun (gloo on CPU, NCCL on GPUs), never MPI or jsrun: drop it": (
        "--mpi --jsrun --mpi-args --tcp --binding-args --mpi-threads-disable --num-nccl-streams"
    ),
    "trainmesh does not ssh into hosts: on several machines start one trainmesh run per machine "
    "(docs/clusters.md), and drop it": "-p --ssh-port -i --ssh-identity-file --network-interface --nics",
    "horovodrun's elastic launch has no counterpart here: hvd.elastic scripts run under torchrun's elastic agent, "
    "trainmesh run --nproc-per-node P --nnodes MIN:MAX --max-restarts R --rdzv-endpoint HOST:PORT script.py "
    "(docs/horovod.md, hvd.elastic)": (
        "--min-np --max-np --min-num-proc --max-num-proc --slots-per-host --slots --host-discovery-script "
        "--elastic-timeout --reset-limit --blacklist-cooldown-range --cooldown-range"
    ),
    "Horovod's timeline is not supported: record the collectives with torch.profiler": (
        "--timeline-filename --timeline-mark-cycles"
    ),
    "a Horovod tuning, logging or build setting with no counterpart here (no tensor fusion, no background "
    "cycle): drop it": (
        "--fusion-threshold-mb --cycle-time-ms --cache-capacity --disable-cache --hierarchical-allreduce "
        "--hierarchical-allgather --autotune --autotune-log-file --autotune-warmup-samples "
        "--autotune-steps-per-sample --autotune-bayes-opt-max-samples --autotune-gaussian-process-noise "
        "--thread-affinity --gloo-timeout-seconds --no-stall-check --stall-check-warning-time-seconds "
        "--stall-check-shutdown-time-seconds --log-level --log-without-timestamp --log-hide-timestamp "
        "--prefix-output-with-timestamp --output-filename --config-file --check-build -cb --disable-stall-check"
    ),
}
REFUSED = {flag: why for why, flags in _REFUSED_GROUPS.items() for flag in flags.split()}
HOST = re.compile(r"[A-Za-z0-9_:][A-Za-z0-9._:-]*")
"""A host name or address as -H takes it (IPv6 too); anything else goes into printed commands, so is refused."""


class HorovodrunError(UserError, ValueError):
    """A horovodrun command line that cannot be mapped; the message says what to change."""


@dataclass(frozen=True)
class HorovodrunArgs:
    np: int
    hosts: tuple[tuple[str, int], ...]  # (host, slots) in horovodrun's order; empty: this host
    start_timeout: int | None
    entry: tuple[str, ...]  # the script (or module) and its arguments
    module: bool  # `python -m module`

    def allocation(self) -> list[tuple[str, int]]:
        """How many processes horovodrun would start on each host: it fills them in order."""
        left, used = self.np, []
        for host, slots in self.hosts:
            if left:
                used.append((host, min(slots, left)))
                left -= used[-1][1]
        return used


def parse(argv: list[str]) -> HorovodrunArgs | None:
    """horovodrun's flags, then the command; None when help was asked for."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        name, eq, inline = argv[i].partition("=") if argv[i].startswith("--") else (argv[i], "", "")
        if name in ("-h", "--help"):
            return None
        if name in VALUE_FLAGS:
            if not eq and i + 1 >= len(argv):
                raise HorovodrunError(f"horovodrun flag {name} needs a value (see trainmesh horovodrun --help)")
            values[VALUE_FLAGS[name]] = inline if eq else argv[i + 1]
            i += 1 if eq else 2
        elif name in ACCEPTED:
            i += 1
        elif name in REFUSED:
            raise HorovodrunError(f"horovodrun flag {name} is not supported: {REFUSED[name]}. Supported: {SUPPORTED}")
        else:
            raise HorovodrunError(f"unknown horovodrun flag {argv[i]!r}. Supported: {SUPPORTED}")
    if "np" not in values:
        raise HorovodrunError("-np N is required (the number of processes), as for horovodrun")
    if "hosts" in values and "hostfile" in values:
        raise HorovodrunError("-H/--hosts and --hostfile both given; give one of them")
    hosts = _hosts(values["hosts"], f"-H {values['hosts']}", _H_FORM) if "hosts" in values else ()
    hosts = _hostfile(Path(values["hostfile"])) if "hostfile" in values else hosts
    np = _positive(values["np"], "-np")
    if hosts and sum(slots for _, slots in hosts) < np:
        total = sum(slots for _, slots in hosts)
        raise HorovodrunError(f"-np {np} asks for more processes than the hosts' {total} slots. Fix: -np {total}")
    timeout = _positive(values["start_timeout"], "--start-timeout") if "start_timeout" in values else None
    entry, module = _command(argv[i:])
    return HorovodrunArgs(np, hosts, timeout, entry, module)


def _positive(raw: str, flag: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise HorovodrunError(f"{flag} {raw!r}: expected a whole number >= 1")
    return int(raw)


_H_FORM = "HOST:SLOTS[,HOST:SLOTS...] with the hosts' names or addresses, e.g. -H node1:4,node2:4"
_HOSTFILE_FORM = "one 'HOST slots=N' per line with the hosts' names or addresses, e.g. node1 slots=4"


def _hosts(spec: str, where: str, form: str) -> tuple[tuple[str, int], ...]:
    """-H host1:4,host2:4 (a host without :SLOTS has 1 slot, as in horovodrun); `where`: the flag and its value,
    `form`: what that flag takes, for messages (a host file's lines reach here as -H's items)."""
    hosts = []
    for item in filter(None, (part.strip() for part in spec.split(","))):
        host, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not HOST.fullmatch(host):
            raise HorovodrunError(
                f"{where}: {host!r} is not a host name (letters, digits and ._:- not starting with -). Fix: {form}"
            )
        hosts.append((host, _positive(slots, f"{where}: the slots of {host}")))
    if not hosts:
        raise HorovodrunError(f"{where}: no host. Fix: {form}")
    return tuple(hosts)


def _hostfile(path: Path) -> tuple[tuple[str, int], ...]:
    """Horovod's host file: one 'HOST slots=N' per line ('HOST:N' and 'HOST' work too); # starts a comment."""
    if not path.is_file():
        raise HorovodrunError(f"--hostfile {path}: no such file")
    items = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"(\S+)\s+slots\s*=\s*(\d+)", line)
            items.append(f"{match.group(1)}:{match.group(2)}" if match else line)
    return _hosts(",".join(items), f"--hostfile {path}", _HOSTFILE_FORM)


def _command(command: list[str]) -> tuple[tuple[str, ...], bool]:
    """`[python [-u]] script.py args` or `python -m module args` -> (entry, module)."""
    usage = "give the Python script, e.g. trainmesh horovodrun -np 2 python train.py --epochs 3"
    if not command:
        raise HorovodrunError(f"no command after horovodrun's flags: {usage}")
    rest = command
    if re.fullmatch(r"python[0-9.]*", Path(command[0]).name):
        rest = [arg for arg in command[1:2] if arg != "-u"] + command[2:]  # torchrun runs Python unbuffered anyway
        if rest[:1] == ["-m"] and len(rest) > 1:
            return tuple(rest[1:]), True
        if not rest or rest[0].startswith("-"):
            raise HorovodrunError(
                f"{shlex.join(command[:2])}: only 'python [-u] script.py' and 'python -m module' are supported: {usage}"
            )
    if not rest[0].endswith(".py") and not Path(rest[0]).is_file():
        raise HorovodrunError(
            f"{rest[0]!r} is not a Python script: trainmesh horovodrun runs Python scripts and modules ({usage})"
        )
    if not Path(rest[0]).is_file():
        raise HorovodrunError(f"script {rest[0]!r} does not exist")
    return tuple(rest), False


def _is_this_host(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1"):
        return True
    names = {socket.gethostname(), socket.gethostname().split(".")[0], socket.getfqdn()}
    return host in names


def launch_options(args: HorovodrunArgs) -> LaunchOptions:
    """trainmesh run's launch for this horovodrun command; several hosts (or another one) are refused with the
    commands to run instead."""
    from trainmesh.launch import LaunchOptions

    used = args.allocation()
    if len(used) > 1:
        raise HorovodrunError(_per_node_commands(args, used))
    if used and not _is_this_host(used[0][0]):
        raise HorovodrunError(
            f"-H {used[0][0]}:{used[0][1]} is another machine, and trainmesh does not start processes there "
            f"(horovodrun does, over ssh). Fix: run this command on {used[0][0]} without -H."
        )
    return LaunchOptions(nproc_per_node=str(args.np), join_timeout_s=args.start_timeout or LaunchOptions.join_timeout_s)


def _per_node_commands(args: HorovodrunArgs, used: list[tuple[str, int]]) -> str:
    placed = ", ".join(f"{n} on {host}" for host, n in used)
    what = f"-np {args.np} over {len(used)} hosts puts {placed}"
    counts = {n for _, n in used}
    if len(counts) > 1:
        return (
            f"{what}, but torchrun starts the same number of processes on every node. Fix: choose -np and the "
            f"slots so that every host gets the same number (e.g. -np {len(used) * min(counts)} with "
            f"{','.join(f'{h}:{min(counts)}' for h, _ in used)}), then run the command this prints on each host."
        )
    master = used[0][0]
    timeout: list[str] = []
    if args.start_timeout:
        timeout = ["--join-timeout", str(args.start_timeout)]
        if args.module:  # torchrun has no --join-timeout: its static rendezvous reads it from --rdzv-conf
            timeout = [f"--rdzv-conf=timeout={args.start_timeout}"]
    lines = []
    for rank, (host, n) in enumerate(used):
        words = ["torchrun"] if args.module else ["trainmesh", "run"]
        words += ["--nnodes", str(len(used)), "--node-rank", str(rank), "--master-addr", master]
        words += ["--master-port", str(DEFAULT_MASTER_PORT), *timeout]
        words += ["--nproc-per-node", str(n), *(["-m"] if args.module else []), *args.entry]
        lines.append(f"  on {host}: {shlex.join(words)}")  # every word quoted: the line is pasted into a shell
    return (
        f"{what}; trainmesh does not start processes on other machines (horovodrun does, over ssh). Run on each "
        f"host (any free port on {master} instead of {DEFAULT_MASTER_PORT}; under SLURM see docs/clusters.md):\n"
        + "\n".join(lines)
    )


def launch_horovodrun(args: HorovodrunArgs) -> int:
    """Launch the command as trainmesh run would; the exit code for the CLI."""
    from trainmesh.launch import launch

    return launch(launch_options(args), list(args.entry), module=args.module)
