"""Fixtures shared by every test folder."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from omnistage.common.runtime.auth import STAGE_KEY_ENV, STAGE_KEY_OFF

# Tests call stages directly (Thinker.Abort, Control.Describe of a stage) next to the pipelines they
# start: no stage key unless a test sets one (tests/common/runtime/test_runtime_stage_key.py does).
os.environ.setdefault(STAGE_KEY_ENV, STAGE_KEY_OFF)


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # `make test` installs it (Debian's prometheus package): absent means CI is broken
        pytest.fail("promtool not found: install Debian's `prometheus` package (`make test` does)")
    return path


@pytest.fixture(scope="session")
def check_metrics():
    """`check_metrics(text)`: fail unless `promtool check metrics` accepts a /metrics exposition."""

    def check(text: str) -> None:
        result = subprocess.run([_promtool(), "check", "metrics"], input=text, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, f"promtool check metrics:\n{result.stdout}{result.stderr}"

    return check
