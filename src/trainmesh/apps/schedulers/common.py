"""What `trainmesh slurm` and `trainmesh k8s` share: their errors and the check of the config they run."""

from __future__ import annotations

import unicodedata
from pathlib import Path

from trainmesh.config import Config
from trainmesh.core.errors import UserError
from trainmesh.job.spec import check_data, load_config, resolve


class SchedulerError(UserError, ValueError):
    """A flag of `trainmesh slurm` or `trainmesh k8s` that cannot work; the message names it and the fix."""


STOP_MARGIN_S = 15
"""Of the time a scheduler allows between its SIGTERM and its SIGKILL, what torchrun's agent leaves over: it gives
its ranks the rest to save and stop (--shutdown-timeout), then still has time to report how they ended."""


def agent_shutdown_timeout(window_s: int) -> int:
    """`trainmesh run --shutdown-timeout` for a scheduler that SIGKILLs `window_s` seconds after its SIGTERM."""
    return max(window_s - STOP_MARGIN_S, (window_s + 1) // 2)


def breaks_a_line(text: str) -> bool:
    """`text` holds a control character or a Unicode line or paragraph separator, which in a job file would end a
    comment or an #SBATCH line and start another (YAML 1.1 reads U+0085, U+2028 and U+2029 as line breaks)."""
    return any(unicodedata.category(c) in ("Cc", "Zl", "Zp") for c in text)


def cpus_per_rank(num_workers: int) -> int:
    """The CPUs a rank needs to keep its GPU fed: one for the rank's own process and one for each of its DataLoader
    workers (data.num_workers), which load and collate the next batches while it trains."""
    return 1 + num_workers


def positive(value: int, flag: str) -> int:
    if value < 1:
        raise SchedulerError(f"{flag}={value}: must be at least 1")
    return value


def check_config(
    config_path: str | None, overrides: list[str], recipe: str, world_sizes: list[int], data_here: bool
) -> tuple[Config, list[str]]:
    """The config (complete) and one line per world size saying how it runs, after every check `trainmesh check`
    makes. `data_here`: data.source is on this machine too (a shared file system), so it is checked as well."""
    if config_path is not None and not Path(config_path).is_file():
        raise SchedulerError(f"--config={config_path!r} does not exist. Fix: the path of a TOML config (configs/).")
    config = load_config(config_path, overrides, recipe)
    if data_here:
        check_data(config)
    lines = []
    for world in world_sizes:
        job = resolve(config, world, world_sizes)
        strategy, dims = job.layout
        lines.append(f"world size {world}: {strategy} on {dims.describe()}; {job.batch.describe()}")
    return config, lines
