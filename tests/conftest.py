"""Fixtures shared by every test folder, and the project's own tools first on PATH."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
from pathlib import Path

import pytest

# Triton kernels (the thinker's and the DiT's) are tested on CPU machines by Triton's interpreter, which
# must be on before anything imports triton (`import torch` does). A machine with an NVIDIA driver
# compiles them.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

from omnistage.common.runtime.auth import STAGE_KEY_ENV, STAGE_KEY_OFF  # noqa: E402  (after the switch above)

# Tests call stages directly (Thinker.Generate, Control.Describe of a stage) next to the pipelines they
# start: no stage key unless a test sets one (tests/common/runtime/test_runtime_stage_key.py does).
os.environ.setdefault(STAGE_KEY_ENV, STAGE_KEY_OFF)

# prometheus, promtool and docker-compose, unpacked from Debian's packages by deploy/test-tools.sh
# (`make test` runs it): found before any of the machine's own.
TOOLS_BIN = Path(__file__).resolve().parents[1] / ".tools" / "bin"
if TOOLS_BIN.is_dir():
    os.environ["PATH"] = os.pathsep.join([str(TOOLS_BIN), os.environ.get("PATH", "")])


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The tests' own process runs torch on one thread. Its tensors (the tiny checkpoints') are too
    small for a second thread to help, and a waiting OpenMP thread spins: on a 2-core machine it
    takes the core from the stages, ranks and servers a test starts beside it (the reason a CPU stage
    takes its share of the cores, common/runtime/cpu_share.py). Measured on a loaded 2-core host:
    the tiny engine tests took 140 -> 20 s of CPU with one thread."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_collection_finish(session: pytest.Session) -> None:
    """What collecting the suite imported (torch, transformers, every test module: ~500k objects) lives
    as long as the session: out of the cyclic GC's reach (gc.freeze), each full collection (the tests',
    the code's, the GC's own) walks only what tests made since, not the whole process (~0.5 s of CPU
    each). Frozen objects are still freed when their last reference goes; collection's own garbage is
    collected first, not kept for the session."""
    gc.collect()
    gc.freeze()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Back in the GC's reach for the interpreter's last collection (Triton's bindings, nanobind, report
    their objects left uncollected at exit as leaks)."""
    gc.unfreeze()


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:  # `make test` installs it (Debian's prometheus package): absent means CI is broken
        pytest.fail("promtool not found: run deploy/test-tools.sh (`make test` does)")
    return path


@pytest.fixture(scope="session")
def check_metrics():
    """`check_metrics(text)`: fail unless `promtool check metrics` accepts a /metrics exposition."""

    def check(text: str) -> None:
        result = subprocess.run(
            [_promtool(), "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 0, f"promtool check metrics:\n{result.stdout}{result.stderr}"

    return check
