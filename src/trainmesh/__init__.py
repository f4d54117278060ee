"""trainmesh: one PyTorch training script from one CPU to many GPU machines.

Library use: `from trainmesh import Runtime` (see runtime/runtime.py and examples/). The names below load
on first use, so that importing a light part of trainmesh (the command line's parser) does not import torch.
"""

from __future__ import annotations

from importlib import import_module, metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainmesh.runtime.runtime import Runtime
    from trainmesh.strategies import DDPOptions

try:
    __version__ = metadata.version("trainmesh")
except metadata.PackageNotFoundError:
    __version__ = "not installed"

__all__ = ["DDPOptions", "Runtime", "__version__"]
_LAZY = {"Runtime": "trainmesh.runtime.runtime", "DDPOptions": "trainmesh.strategies"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'trainmesh' has no attribute {name!r}")
