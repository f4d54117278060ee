"""The launch flags of `trainmesh run`, `check` and `bench`: torchrun's, under both of its spellings, each read
from torchrun's PET_<FLAG> variable when left out (argparse only: the parser stays instant)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from trainmesh.core.env import read_var, var_is_set


class BadEnvironmentValue(str):
    """A launch flag's PET_<FLAG> value that does not convert: kept until the command line has been read whole
    (the flag may still follow the recipe's name), then refused by `refuse_bad_environment`."""


def _or_from_environment(convert: Callable[[str], Any], variable: str, flag: str) -> Callable[[str], Any]:
    """`convert`, except that a bad value from the environment is not an error yet (argparse converts a default
    before it has seen a flag given after the recipe's name), and its error names the variable, which argparse's
    would not."""

    def parse(value: str) -> Any:
        try:
            return convert(value)
        except ValueError:
            if not var_is_set(variable) or value != read_var(variable):
                raise
            return BadEnvironmentValue(
                f"{variable}={value!r}, from the environment (a launch flag left out is read from PET_<FLAG>, as "
                f"torchrun does), is not a valid {flag}. Fix: correct or unset {variable}, or give {flag}."
            )

    parse.__name__ = getattr(convert, "__name__", "value")  # argparse's "invalid int value: ..."
    return parse


def refuse_bad_environment(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Once the command line has been read: a launch flag left out whose PET_<FLAG> does not convert."""
    for value in vars(args).values():
        if isinstance(value, BadEnvironmentValue):
            parser.error(str(value))


def add_launch_flags(parser: argparse.ArgumentParser, defaults: bool = True) -> None:
    """torchrun's launch flags, under both spellings torchrun accepts (--nproc-per-node, --nproc_per_node).

    As torchrun's, a flag left out takes its value from PET_<FLAG> (PET_NNODES, PET_NODE_RANK, ...) when set:
    Kubeflow's operators describe the job to a pod's torchrun that way, so `trainmesh run` needs no flags there.
    """
    g = parser.add_argument_group(
        "launch (torchrun's flags; --flag_name spellings work too; a flag left out is read from PET_<FLAG> as "
        "torchrun does, e.g. PET_NNODES)"
    )

    def flag(name: str, default: Any, torchrun: bool = True, **kwargs: Any) -> None:
        dest = name.replace("-", "_")
        if torchrun and "type" in kwargs:
            kwargs["type"] = _or_from_environment(kwargs["type"], f"PET_{dest.upper()}", f"--{name}")
        if not defaults:
            default = argparse.SUPPRESS
        elif torchrun:
            variable = f"PET_{dest.upper()}"
            default = read_var(variable) if var_is_set(variable) else default  # argparse applies type= to it
        g.add_argument(f"--{name}", *([f"--{dest}"] if dest != name else []), default=default, **kwargs)

    flag("nproc-per-node", "auto", help="processes per node: N or auto (all GPUs, else 2)")
    flag("nnodes", "1", help="nodes: N, or MIN:MAX for elastic membership")
    flag("node-rank", 0, type=int, help="this node's rank (static rendezvous)")
    flag("master-addr", None, help="address of node 0 (static rendezvous)")
    flag("master-port", None, type=int, help="port on node 0 (default: a free one)")
    flag("rdzv-endpoint", None, help="HOST:PORT of the c10d rendezvous (elastic)")
    flag("rdzv-id", None, help="job id shared by all nodes (c10d rendezvous)")
    flag("max-restarts", 0, type=int, help="restarts of the worker group on failure")
    flag("join-timeout", 300, torchrun=False, type=int, help="seconds the nodes may take to meet (default 300)")
    flag(
        "shutdown-timeout",
        None,
        type=int,
        help="seconds the agent, once signalled (SIGTERM), gives the ranks to save and stop before it SIGKILLs them "
        "(torchrun's; default TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30)",
    )
    flag("rdzv-conf", None, help="more c10d rendezvous settings: KEY=VALUE[,...] (torchrun's)")
    d = (lambda value: value) if defaults else (lambda value: argparse.SUPPRESS)
    g.add_argument(
        "--standalone",
        action="store_true",
        default=d(False),
        help="one node, rendezvous on loopback at a free port (torchrun's flag; what trainmesh does by default)",
    )
    flag(
        "log-dir",
        None,
        help="where each launch keeps every rank's stdout and stderr, in <dir>/<launch>/attempt_<n>/rank_<r>/ "
        "(default: <run>/logs for a recipe; none: no files, every rank on the console, as plain torchrun)",
    )
    flag("redirects", None, help="torchrun's: streams only in files, 0-3 or LOCAL_RANK:N,... (default 0)")
    flag("tee", None, help="torchrun's: streams in files and on the console (default with logs: 3, both)")
    flag(
        "local-ranks-filter",
        None,
        help="torchrun's: local ranks shown on the console, e.g. 0,1 (default with logs: 0; '': all)",
    )
