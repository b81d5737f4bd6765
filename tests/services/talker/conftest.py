"""Shared fixtures of the talker tests: one tiny talker checkpoint and its models per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.tiny_talker import write_tiny_talker
from omnistage.services.talker.models.loader import TalkerModels, load_talker


@pytest.fixture(scope="session")
def talker_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only `talker/` (all the talker reads)."""
    root = tmp_path_factory.mktemp("tiny-talker")
    write_tiny_talker(root, seed=0)
    return root


@pytest.fixture(scope="session")
def talker_models(talker_ckpt: Path) -> TalkerModels:
    return load_talker(talker_ckpt, dtype=torch.float32, device="cpu")
