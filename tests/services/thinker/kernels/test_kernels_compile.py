"""Every thinker kernel compiles for sm_90 in bf16 with the constants the fast path uses (the
interpreter accepts code the compiler rejects; this caught a reassigned constexpr once). The
compile runs in a child process without TRITON_INTERPRET (this folder's conftest sets it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.services.thinker.kernels.sm90_compile import CASES


def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600
    )
    lines = result.stdout.splitlines()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert sorted(line.split()[1] for line in lines if line.startswith("ok ")) == sorted(CASES)
