"""trainmesh: one PyTorch training script from one CPU to many GPU machines.

Library use (see docs/library.md and examples/):

    from trainmesh import Runtime                 # your own loop: device, strategy, precision, collectives
    from trainmesh import load_config, resolve    # a trainmesh config, resolved for a world size (a Job)

The names below load on first use, so that importing a light part of trainmesh (the command line's parser)
does not import torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmesh.config.schema import (
        Config,
        DDPConfig,
        DistConfig,
        Float8Config,
        FSDPConfig,
        ParallelConfig,
        PipelineConfig,
    )
    from trainmesh.job import Job, load_config, resolve
    from trainmesh.recipes.base import Datasets, Recipe
    from trainmesh.runtime.runtime import Runtime
    from trainmesh.worker import run_worker

try:
    __version__ = metadata.version("trainmesh")
except metadata.PackageNotFoundError:
    __version__ = "not installed"

_LAZY = {
    "Runtime": "trainmesh.runtime.runtime",
    "Config": "trainmesh.config.schema",
    "DDPConfig": "trainmesh.config.schema",
    "DistConfig": "trainmesh.config.schema",
    "FSDPConfig": "trainmesh.config.schema",
    "Float8Config": "trainmesh.config.schema",
    "ParallelConfig": "trainmesh.config.schema",
    "PipelineConfig": "trainmesh.config.schema",
    "Job": "trainmesh.job",
    "load_config": "trainmesh.job",
    "resolve": "trainmesh.job",
    "Recipe": "trainmesh.recipes.base",
    "Datasets": "trainmesh.recipes.base",
    "run_worker": "trainmesh.worker",
}
__all__ = [
    "Config",
    "DDPConfig",
    "Datasets",
    "DistConfig",
    "FSDPConfig",
    "Float8Config",
    "Job",
    "ParallelConfig",
    "PipelineConfig",
    "Recipe",
    "Runtime",
    "__version__",
    "load_config",
    "resolve",
    "run_worker",
]
assert set(__all__) == {*_LAZY, "__version__"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainmesh' has no attribute {name!r}")
