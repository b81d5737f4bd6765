"""Checkpoint files: sharded safetensors reading/writing and the tiny Ming checkpoint writer."""

from omnistage.common.checkpoint.shards import (
    CheckpointError,
    TensorInfo,
    iter_tensors,
    read_headers,
    shard_files,
    write_sharded,
)
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

__all__ = [
    "CheckpointError",
    "TensorInfo",
    "iter_tensors",
    "read_headers",
    "shard_files",
    "write_sharded",
    "write_tiny_checkpoint",
]
