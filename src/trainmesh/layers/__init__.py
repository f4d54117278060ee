"""Model layers that know about the process group (today: SyncBatchNorm with a CPU/gloo path)."""

from trainmesh.layers.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
