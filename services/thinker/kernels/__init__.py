"""Triton kernels of the thinker's fast paths (fused MoE, paged decode attention, KV writes).

Imported only when a fast backend is chosen (`models/layers/backends.py`), never by the reference
path, so a CPU install needs no triton. On a CPU, tests run these kernels in fp32 under
`TRITON_INTERPRET=1` (set before triton is imported) against the torch reference.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def triton_available() -> bool:
    """triton is importable (its kernels run on CUDA devices, or anywhere under TRITON_INTERPRET=1)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """TRITON_INTERPRET=1: the kernels run on CPU tensors (the tests' fp32 checks)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def runs_triton(device: torch.device) -> bool:
    """Whether a Triton launch runs on `device`: a CUDA device, or any under the interpreter."""
    return triton_available() and (device.type == "cuda" or interpreting())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs multiply in full precision (the fp32 checks against the reference), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"
