"""Run directories: `<run.out_dir>/<run.name>/`, named once and holding the resolved config.

Both the launcher (before any process starts) and a worker started without it (plain torchrun, srun,
python) create them; only rank 0 of a job writes into them afterwards.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path

from trainmesh.config import Config, dump_toml
from trainmesh.config.loader import config_to_dict

CONFIG_FILE = "config.toml"


def default_run_name(recipe: str) -> str:
    return f"{recipe}-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def write_config(run_dir: Path, config: Config) -> Path:
    """Write the resolved config atomically (several node launchers may write the same file)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CONFIG_FILE
    tmp = path.with_name(f".{CONFIG_FILE}.{os.getpid()}")
    tmp.write_text(dump_toml(config_to_dict(config)))
    tmp.replace(path)
    return path
