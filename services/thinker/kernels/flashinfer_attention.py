"""Prefill and mixed steps' attention through FlashInfer's paged prefill, planned once per step.

FlashInfer (`flashinfer-python`, the `gpu` extra; carried to a GPU machine by
`bench/flashinfer_carry.sh`) is optional: nothing imports it unless `engine.attention_backend` asks
for it (or `auto` finds it). Its `BatchPrefillWithPagedKVCacheWrapper` takes our cache as it is —
one layer's K and V, each [num_blocks, block_size, kv_heads, head_dim] (layout NHD, page size = our
block size) — and every sequence of a step (a prompt chunk over its cached prefix, or a decode row)
as one ragged batch: `qo_indptr` over the flattened new tokens, each sequence's pages
(`kv_indices`, its block-table row cut to its context) and the fill of its last page. Its causal mask
is aligned to the end of each sequence's keys, which is our rule (query t of a chunk starting at
position p sees keys 0..p+t). The plan depends only on the step's layout, so the first layer of a
step plans and the others reuse it; `plan` reads host tensors only, so it never waits on the GPU.

Every failure — the import, the JIT build inside the first `plan`, a dtype it does not run (fp32) —
is logged once and returns None: the caller falls back to the Triton kernel for good, never a crash.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch
from omnistage.common.log import get_logger

log = get_logger(__name__)

# The version the carry and the extra pin (0.5.3: a 7 MB pure-Python wheel that JIT-builds its
# kernels with the machine's nvcc; 0.7 is 100 MB with more dependencies).
FLASHINFER_VERSION = "0.5.3"
WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partial results)
DTYPES = (torch.float16, torch.bfloat16)
# FlashInfer's own kernel family for the wrapper: auto (fa3 on Hopper, else fa2) | fa2 | fa3.
BACKEND_ENV = "OMNISTAGE_FLASHINFER_BACKEND"


def flashinfer_unavailable(device: torch.device) -> str:
    """Why FlashInfer cannot serve this device ("" when it can): the package, the device, its arch."""
    if device.type != "cuda":
        return f"it needs a CUDA device (device {device})"
    if importlib.util.find_spec("flashinfer") is None:
        return "the flashinfer package is not installed (pip install 'omnistage[gpu]', or bench/flashinfer_carry.sh)"
    try:
        importlib.import_module("flashinfer")
    except Exception as exc:  # noqa: BLE001 - whatever breaks its import, the answer is "not here"
        return f"import flashinfer failed: {type(exc).__name__}: {exc}"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return f"it needs compute capability 8.0 or newer ({torch.cuda.get_device_name(device)})"
    return ""


def kv_layout(
    query_lens: list[int], context_lens: list[int], tables: torch.Tensor, page: int
) -> tuple[torch.Tensor, ...]:
    """The step as FlashInfer's ragged batch, on the host: (qo_indptr, kv_indptr, kv_indices,
    kv_last_page_len), int32. `tables` [S, W] are the host block tables (-1 padded)."""
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    pages = (ctx + page - 1) // page
    qo = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    qo[1:] = torch.tensor(query_lens, dtype=torch.int32).cumsum(0)
    kv = torch.zeros(len(context_lens) + 1, dtype=torch.int32)
    kv[1:] = pages.cumsum(0)
    used = torch.arange(tables.shape[1])[None, :] < pages[:, None]  # each row's first `pages` blocks
    indices = tables[used].to(torch.int32)
    return qo, kv, indices, ctx - (pages - 1) * page


class FlashInferPrefill:
    """One wrapper and workspace per device; `run` returns None once FlashInfer has failed here."""

    def __init__(self) -> None:
        self.wrapper: Any = None
        self.failed = ""  # why FlashInfer stopped serving this process ("" while it serves)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: Any, scale: float):
        """Attention of the step's new tokens q [T, H, D] over the cache (K/V already written), or
        None when FlashInfer cannot (the reason logged once)."""
        if self.failed:
            return None
        try:
            if "flashinfer" not in md.step_state:
                self._plan(q, k_cache, md, scale)
                md.step_state["flashinfer"] = True
            return self.wrapper.run(q, (k_cache, v_cache))
        except Exception as exc:  # noqa: BLE001 - any failure: the Triton kernel takes over for good
            self.fail(f"{type(exc).__name__}: {exc}")
            return None

    def fail(self, why: str) -> None:
        if not self.failed:
            self.failed = why
            log.warning("attention: FlashInfer prefill off, the Triton kernel serves prefill steps: %s", why)

    def _plan(self, q: torch.Tensor, k_cache: torch.Tensor, md: Any, scale: float) -> None:
        if q.dtype not in DTYPES:
            raise TypeError(f"FlashInfer attention runs fp16/bf16, not {q.dtype}")
        if md.host_block_tables is None:
            raise ValueError("the step's metadata carries no host block tables")
        if self.wrapper is None:
            flashinfer = importlib.import_module("flashinfer")
            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            family = os.environ.get(BACKEND_ENV, "auto")
            self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=family)
        _, page, num_kv_heads, head_dim = k_cache.shape
        qo, kv, indices, last = kv_layout(md.query_lens, md.context_lens, md.host_block_tables, page)
        self.wrapper.plan(
            qo,
            kv,
            indices,
            last,
            q.shape[1],
            num_kv_heads,
            head_dim,
            page,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
        )
