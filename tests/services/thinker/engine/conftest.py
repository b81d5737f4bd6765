"""Fixtures of the engine tests (the tiny checkpoint, written once per session)."""

from __future__ import annotations

import pytest
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)
