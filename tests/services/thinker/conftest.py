"""Fixtures of the thinker service tests (server, engine loop): the tiny checkpoint, the engine doubles."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The engine test doubles (engine_fakes.py) serve the service-level tests too.
sys.path.insert(0, str(Path(__file__).parent / "engine"))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.common.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)
