"""The thinker's Triton kernels on a CPU: TRITON_INTERPRET=1 must be set before triton is imported
(the kernels are decorated at import), so it is set here, before any test module of this folder
imports them. triton is a dev dependency: these tests never skip for want of it."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)
