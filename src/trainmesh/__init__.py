"""trainmesh: one PyTorch training script from one CPU to many GPU machines.

Library use (see docs/library.md and examples/):

    from trainmesh import Runtime                 # your own loop: device, strategy, precision, collectives
    from trainmesh import load_config, resolve    # a trainmesh config, resolved for a world size (a Job)

The names below load on first use, so that importing a light part of trainmesh (the command line's parser)
does not import torch. Three documented modules live in the rooms of their kind and keep their short names:
`trainmesh.horovod` (compat/horovod), `trainmesh.testing` (launch/spawn.py) and `trainmesh.integrations.ray`
(compat/ray.py); importing the short or the real name gives the one module object.
"""

from __future__ import annotations

import sys
from importlib import import_module, metadata
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType
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
    from trainmesh.job.spec import Job, load_config, resolve
    from trainmesh.job.worker import run_worker
    from trainmesh.recipes.base import Datasets, Recipe
    from trainmesh.runtime.runtime import Runtime

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
    "Job": "trainmesh.job.spec",
    "load_config": "trainmesh.job.spec",
    "resolve": "trainmesh.job.spec",
    "Recipe": "trainmesh.recipes.base",
    "Datasets": "trainmesh.recipes.base",
    "run_worker": "trainmesh.job.worker",
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


# The short public names of modules that live elsewhere (their submodules follow: trainmesh.horovod.ops is
# trainmesh.compat.horovod.ops, the same module object, never a second copy with state of its own).
ALIASES = {
    "trainmesh.horovod": "trainmesh.compat.horovod",
    "trainmesh.testing": "trainmesh.launch.spawn",
    "trainmesh.integrations": "trainmesh.compat",
}


class _AliasFinder(MetaPathFinder, Loader):
    """Imports an alias (ALIASES) as the module it names."""

    @staticmethod
    def target(name: str) -> str | None:
        for alias, real in ALIASES.items():
            if name == alias or name.startswith(alias + "."):
                return real + name[len(alias) :]
        return None

    def find_spec(self, name: str, path: object = None, target: object = None) -> ModuleSpec | None:
        return ModuleSpec(name, self) if self.target(name) else None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        real = self.target(spec.name)
        assert real is not None
        module = import_module(real)
        spec.loader_state = module.__spec__  # the import system sets the alias's spec on it: put the real one back
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = module.__spec__.loader_state if module.__spec__ else None


if not any(isinstance(finder, _AliasFinder) for finder in sys.meta_path):
    sys.meta_path.insert(0, _AliasFinder())
