"""Versions of trainmesh and what it runs on, recorded in checkpoints and printed by `trainmesh env`."""

from __future__ import annotations

import platform
from importlib import metadata


def package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    import torch  # here: package_version serves `data prepare`, which keeps torch out of its processes

    return {
        "trainmesh": package_version("trainmesh"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "numpy": package_version("numpy"),
    }
