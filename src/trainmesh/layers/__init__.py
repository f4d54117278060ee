"""Model layers trainmesh adds to PyTorch's: SyncBatchNorm with a CPU/gloo path, and a language model's head fused
with its cross-entropy a chunk of tokens at a time (layers/linear_cross_entropy.py)."""

from trainmesh.layers.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
