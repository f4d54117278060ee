"""DTensor checks that do not import DTensor. `torch.distributed.tensor` takes about a second to import (sympy and the
sharding rules) in every process; where it was never imported no DTensor exists, so a job that shards nothing and
saves nothing (ddp, one process) never pays for it. Code that makes DTensors imports torch.distributed.tensor itself.
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any, TypeGuard

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

_MODULE = "torch.distributed.tensor"


def is_dtensor(value: object) -> TypeGuard[DTensor]:
    """isinstance(value, DTensor), without importing DTensor where nothing has."""
    module = sys.modules.get(_MODULE)
    return module is not None and isinstance(value, module.DTensor)


def implicit_replication() -> contextlib.AbstractContextManager[Any]:
    """DTensor's implicit replication (plain tensors meet DTensors as replicated), where DTensors may exist."""
    if _MODULE not in sys.modules:
        return contextlib.nullcontext()
    from torch.distributed.tensor.experimental import implicit_replication as replicate

    return replicate()
