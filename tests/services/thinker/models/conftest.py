"""Shared fixtures for the thinker model tests: one tiny Ming checkpoint per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint import write_tiny_checkpoint
from omnistage.services.thinker.models.loader import load_model


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_ckpt: Path):
    return load_model(tiny_ckpt, dtype=torch.float32, device="cpu")
