"""The thinker's Triton kernels on a CPU: TRITON_INTERPRET=1 must be set before triton is imported
(the kernels are decorated at import), so it is set here, before any test module of this folder
imports them. triton is a dev dependency: these tests never skip for want of it. The tiny
checkpoints are the folder above's (tests/services/thinker/conftest.py)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
