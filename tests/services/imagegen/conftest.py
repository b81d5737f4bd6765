"""Shared fixtures of the image-generation tests: one tiny checkpoint, its models and pipeline per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint import write_tiny_checkpoint
from omnistage.services.imagegen.models.loader import ImageGenModels, load_imagegen
from omnistage.services.imagegen.pipeline import ImagePipeline


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming-img"), seed=0)


@pytest.fixture(scope="session")
def tiny_models(tiny_ckpt: Path) -> ImageGenModels:
    return load_imagegen(tiny_ckpt, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def pipeline(tiny_models: ImageGenModels) -> ImagePipeline:
    return ImagePipeline(tiny_models, "cpu")
