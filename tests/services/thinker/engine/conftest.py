"""Fixtures of the engine tests (the tiny checkpoint, written once per session)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    tiny = pytest.importorskip("omnistage.common.checkpoint.tiny")
    return tiny.write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)
