"""Fixtures of the e2e tests: one tiny checkpoint for the session (the pipelines read it, none writes it;
writing it costs a module a second or two of CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight checkpoint of seed 0, written once."""
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming") / "ckpt", seed=0)
