"""trainmesh: one PyTorch training script from one CPU to many GPU machines.

Library use: `from trainmesh import Runtime` (see runtime/runtime.py and examples/).
"""

from trainmesh.runtime.runtime import Runtime
from trainmesh.strategies import DDPOptions
from trainmesh.versions import package_version

__version__ = package_version("trainmesh")

__all__ = ["DDPOptions", "Runtime", "__version__"]
