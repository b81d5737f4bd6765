"""Shared fixtures of the encoder tests: one tiny Ming checkpoint and its towers per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint import write_tiny_checkpoint
from omnistage.common.checkpoint.shards import iter_tensors, shard_files
from omnistage.services.encoder.models.loader import EncoderModels, load_encoders


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming-enc"), seed=0)


@pytest.fixture(scope="session")
def tiny_encoders(tiny_ckpt: Path) -> EncoderModels:
    return load_encoders(tiny_ckpt, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def raw_tensors(tiny_ckpt: Path) -> dict[str, torch.Tensor]:
    """Every checkpoint tensor as float32 (for building reference models)."""
    return {k: v.float() for shard in shard_files(tiny_ckpt) for k, v in iter_tensors(shard)}
