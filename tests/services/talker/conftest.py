"""Shared fixtures of the talker tests: one tiny talker checkpoint and its models per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.tiny_talker import write_tiny_talker
from omnistage.services.talker.models.loader import TalkerModels, load_talker
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voices import VoiceBank


@pytest.fixture(scope="session")
def talker_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint folder holding only `talker/` (all the talker reads)."""
    root = tmp_path_factory.mktemp("tiny-talker")
    write_tiny_talker(root, seed=0)
    return root


@pytest.fixture(scope="session")
def talker_models(talker_ckpt: Path) -> TalkerModels:
    return load_talker(talker_ckpt, dtype=torch.float32, device="cpu")


@pytest.fixture(scope="session")
def voices(talker_ckpt: Path, talker_models: TalkerModels) -> VoiceBank:
    """The tiny checkpoint's preset voices (seed 0)."""
    bank = VoiceBank(talker_models, SpeakerEncoder(talker_ckpt / "talker/campplus.onnx"), "DB30", 20.0)
    bank.load_presets(seed=0)
    return bank
