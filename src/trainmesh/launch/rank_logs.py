"""Every rank's stdout and stderr kept in files, `<log dir>/<launch>/attempt_<n>/rank_<r>/`, through torchrun's own
`LogsSpecs` hook.

Details: docs/internals.md#launchrank_logspy
"""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, Std, to_map

from trainmesh.core.files import make_new_dir, open_file

LOGS_DIR = "logs"
"""The run folder's folder of per-rank logs (the default --log-dir of a recipe's run)."""
NO_LOG_DIR = "none"
STDOUT, STDERR, ERROR_FILE = "stdout.log", "stderr.log", "error.json"
PREFIX = "[rank${rank}]:"
"""The console prefix of a worker's lines (torchrun's log_line_prefix_template): the global rank."""


@dataclass(frozen=True)
class LogSettings:
    """`--log-dir`, `--redirects`, `--tee` and `--local-ranks-filter` as given; None: the default."""

    log_dir: str | None = None
    """Where each launch keeps its ranks' logs; None: <run>/logs (a recipe's run); none: no files (torchrun's
    console behaviour)."""
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: str | None = None

    @property
    def kept(self) -> bool:
        """Whether the ranks' output goes to files (unset: into the run folder, which the launcher fills in)."""
        return self.log_dir not in ("", NO_LOG_DIR)

    def torchrun_flags(self) -> tuple[str, str, str]:
        """(redirects, tee, local ranks filter): the given ones, else trainmesh's defaults when logs are kept (all
        in files and on the console, where local rank 0 alone is shown), else torchrun's (all on the console)."""
        defaults = ("0", "3", "0") if self.kept else ("0", "0", "")
        given = (self.redirects, self.tee, self.local_ranks_filter)
        return tuple(d if g is None else g for g, d in zip(given, defaults, strict=True))  # type: ignore[return-value]

    def check(self, nproc: int) -> None:
        """Refuse values torchrun cannot parse, and a filter that would drop a rank's output (ValueError)."""
        redirects, tee, shown = self.torchrun_flags()
        parsed = {}
        for flag, value in (("--redirects", redirects), ("--tee", tee)):
            try:
                parsed[flag] = to_map(Std.from_str(value), nproc)
            except ValueError:
                raise ValueError(
                    f"{flag}={value!r}: expected 0 (none), 1 (stdout), 2 (stderr) or 3 (both), for every local rank "
                    "or as LOCAL_RANK:VALUE,... (e.g. 0:3,1:2)"
                ) from None
        on_console = _ranks(shown)
        hidden = [r for r in range(nproc) if on_console is not None and r not in on_console]
        lost = [r for r in hidden if (parsed["--redirects"][r] | parsed["--tee"][r]) != Std.ALL]
        if lost:
            where = "no log file (--log-dir none)" if not self.kept else "no file for both streams (--tee/--redirects)"
            raise ValueError(
                f"--local-ranks-filter={shown} hides local rank(s) {lost} from the console, and they have {where}: "
                "their output would be lost. Fix: keep them in files (--tee 3 with a --log-dir), or show them "
                "(--local-ranks-filter with their numbers)."
            )
        if self.log_dir and self.kept and Path(self.log_dir).is_file():
            raise ValueError(f"--log-dir={self.log_dir}: that is a file. Fix: a folder, or none for no log files.")

    def specs(self, launch_folder: Path) -> RankLogs:
        redirects, tee, shown = self.torchrun_flags()
        return RankLogs(launch_folder, Std.from_str(redirects), Std.from_str(tee), _ranks(shown))


def _ranks(text: str) -> set[int] | None:
    """--local-ranks-filter's ranks; None: all."""
    if not text.strip():
        return None
    try:
        return {int(part) for part in text.split(",")}
    except ValueError:
        raise ValueError(f"--local-ranks-filter={text!r}: expected local ranks, e.g. 0 or 0,1") from None


def claim_launch_folder(log_dir: Path, multi_node: bool) -> Path:
    """A new folder for this launch's logs under `log_dir`, named when it started (and on which host, when the
    launch is one node of several), created here so that no other launch writes into it."""
    log_dir.mkdir(parents=True, exist_ok=True)
    base = dt.datetime.now().strftime("%Y%m%d-%H%M%S") + (f"-{socket.gethostname()}" if multi_node else "")
    folder = make_new_dir(log_dir, base, limit=999)
    if folder is None:
        raise FileExistsError(f"{log_dir} already holds 999 launches named {base}*")
    return folder


class RankLogs(LogsSpecs):
    """torchrun's log files of one launch in `<folder>/attempt_<n>/rank_<r>/` (docs/internals.md#launchrank_logspy)."""

    def __init__(
        self,
        folder: Path,
        redirects: Std | dict[int, Std],
        tee: Std | dict[int, Std],
        local_ranks_filter: set[int] | None,
    ) -> None:
        super().__init__(str(folder), redirects, tee, local_ranks_filter)
        self.folder = folder

    @property
    def root_log_dir(self) -> str:
        return str(self.folder)

    def shown(self, local_rank: int) -> bool:
        """Whether the console showed this local rank's output (the rest went to its files only)."""
        return self._local_ranks_filter is None or local_rank in self._local_ranks_filter

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of each local rank's streams (torchrun calls it at every (re)start, with the workers'
        environments, where it also learns each one's error file). The same rules as torch's DefaultLogsSpecs:
        a stream in `redirects` or `tee` goes to its file, a tee'd one also to the console unless filtered out,
        and one neither kept nor shown is dropped."""
        n = len(envs)
        attempt = _claim_attempt_folder(self.folder, envs[0]["TORCHELASTIC_RESTART_COUNT"] if n else "0")
        redirects, tee = to_map(self._redirects, n), to_map(self._tee, n)
        dest = LogsDest(
            filtered_stdout=str(attempt / "filtered_stdout.log"), filtered_stderr=str(attempt / "filtered_stderr.log")
        )
        for local_rank, env in envs.items():
            folder = attempt / f"rank_{env['RANK']}"
            folder.mkdir(exist_ok=True)
            keep, shown = redirects[local_rank] | tee[local_rank], self.shown(local_rank)
            for std, name, files, tees in (
                (Std.OUT, STDOUT, dest.stdouts, dest.tee_stdouts),
                (Std.ERR, STDERR, dest.stderrs, dest.tee_stderrs),
            ):
                if keep & std:
                    files[local_rank] = str(folder / name)
                    if tee[local_rank] & std and shown:
                        tees[local_rank] = files[local_rank]
                else:
                    files[local_rank] = "" if shown else os.devnull  # "": the console, as torch spells it
            dest.error_files[local_rank] = str(folder / ERROR_FILE)
            env["TORCHELASTIC_ERROR_FILE"] = dest.error_files[local_rank]
        return dest


def _claim_attempt_folder(launch: Path, restart: str) -> Path:
    """`attempt_<restart>`, new: when nodes join or leave, the agent restarts its workers without counting a
    restart, and torch opens their files for writing, which would empty the earlier round's; a round after the
    first of an attempt gets `attempt_<restart>-2`, `-3`..."""
    folder = make_new_dir(launch, f"attempt_{restart}")
    if folder is None:
        raise FileExistsError(f"{launch} already holds 10000 rounds of attempt_{restart}")
    return folder


def tail(path: Path, lines: int = 20) -> str:
    """The last `lines` lines of a log file (read from its last 64 KiB: a traceback's end, not the whole run)."""
    with open_file(path, "rb") as f:
        f.seek(max(0, path.stat().st_size - 64 * 1024))
        text = f.read().decode(errors="replace")
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])
