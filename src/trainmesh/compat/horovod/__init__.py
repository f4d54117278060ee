"""Horovod's PyTorch API on torch.distributed: a Horovod script changed only in its import trains under
`trainmesh run` (or `trainmesh horovodrun -np N`).

    import trainmesh.horovod as hvd      # was: import horovod.torch as hvd

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

What is supported, what is refused and how the two differ: docs/horovod.md.
"""

from trainmesh.compat.horovod import elastic
from trainmesh.compat.horovod.basics import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from trainmesh.compat.horovod.compression import Compression
from trainmesh.compat.horovod.errors import HorovodInternalError, HostsUpdatedInterrupt
from trainmesh.compat.horovod.exchange import (
    alltoall,
    alltoall_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
)
from trainmesh.compat.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from trainmesh.compat.horovod.gather import (
    allgather,
    allgather_async,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
)
from trainmesh.compat.horovod.handles import Handle, poll, synchronize
from trainmesh.compat.horovod.ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from trainmesh.compat.horovod.optimizer import DistributedOptimizer
from trainmesh.compat.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from trainmesh.compat.horovod.rounds import RankJoinedError, join
from trainmesh.layers import SyncBatchNorm  # Horovod's hvd.SyncBatchNorm takes the same arguments

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "Handle",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "RankJoinedError",
    "ReduceOp",
    "Sum",
    "SyncBatchNorm",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]
