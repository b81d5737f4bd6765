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
    """The full tiny pipeline, started by its first user and stopped (SIGTERM: exit 0, nothing left)
    once the e2e tests are done."""
    front = full_pipeline.start(tmp_path_factory.mktemp("full-pipeline"), tiny_ckpt)
    yield front
    full_pipeline.stop(front)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The modules that use `shared_pipeline` run last of the e2e tests, one after the other (each in
    its own order): the package-scoped pipeline then stops right after its last user instead of idling
    (~4 s of CPU a minute, five processes' health checks) through the modules between them."""
    here = Path(__file__).parent
    at = [i for i, item in enumerate(items) if here in item.path.parents]
    if not at or at[-1] - at[0] + 1 != len(at):  # e2e items not in one run: leave the order alone
        return
    block = items[at[0] : at[-1] + 1]
    users = {item.path for item in block if "shared_pipeline" in getattr(item, "fixturenames", ())}
    items[at[0] : at[-1] + 1] = [i for i in block if i.path not in users] + [
        i for i in block if i.path in users
    ]
