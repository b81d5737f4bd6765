"""Fixtures of the thinker service tests (server, engine loop): the tiny checkpoint (the engine doubles
are imported from tests.services.thinker.engine.engine_fakes)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.common.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)
