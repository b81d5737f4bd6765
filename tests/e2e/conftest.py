"""Fixtures of the e2e tests: one tiny checkpoint for the session (the pipelines read it, none writes it;
writing it costs a module a second or two of CPU), and the full tiny pipeline its users share
(tests/e2e/full_pipeline.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e import full_pipeline


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random-weight checkpoint of seed 0, written once."""
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming") / "ckpt", seed=0)


@pytest.fixture(scope="package")
def shared_pipeline(tmp_path_factory: pytest.TempPathFactory, tiny_ckpt: Path):
    """The full tiny pipeline, started by its first user and stopped (SIGTERM, exit 0) once the e2e
    tests are done."""
    front = full_pipeline.start(tmp_path_factory.mktemp("full-pipeline"), tiny_ckpt)
    yield front
    front["serve"].stop()
