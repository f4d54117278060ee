"""Rank-aware logging: rank 0 speaks at INFO, the other ranks only at WARNING and above.

Every record carries the rank, so the lines of a multi-process job can be told apart when a warning
from rank 3 shows up between rank 0's progress lines.
"""

from __future__ import annotations

import logging
import sys

LOGGER_NAME = "trainmesh"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank = rank
        self.world_size = world_size

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_tag = f"[rank{self.rank}] " if self.world_size > 1 else ""
        return self.rank == 0 or record.levelno >= logging.WARNING


def get_logger(name: str = "") -> logging.Logger:
    """The trainmesh logger, or a child of it (`get_logger(__name__)`)."""
    if not name or name == LOGGER_NAME:
        return logging.getLogger(LOGGER_NAME)
    if name.startswith(LOGGER_NAME + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{LOGGER_NAME}.{name}")


def configure_logging(rank: int = 0, world_size: int = 1, level: int = logging.INFO) -> logging.Logger:
    """Install one stderr handler on the trainmesh logger; calling it again re-tags the rank."""
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    logger.propagate = False
    for handler in list(logger.handlers):
        if getattr(handler, "_trainmesh", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(sys.stderr)
    handler._trainmesh = True  # type: ignore[attr-defined]
    handler.addFilter(_RankFilter(rank, world_size))
    handler.setFormatter(logging.Formatter("%(asctime)s %(rank_tag)s%(levelname)s %(message)s", "%H:%M:%S"))
    logger.addHandler(handler)
    return logger
