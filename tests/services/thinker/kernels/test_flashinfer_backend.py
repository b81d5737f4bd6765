"""The FlashInfer attention backend without FlashInfer: a stand-in module that computes what its
documented API says (`BatchPrefillWithPagedKVCacheWrapper.plan` / `run`: ragged queries, each
request's pages, the fill of its last page, a causal mask aligned to the end of its keys) checks the
layout we hand it against the reference; every failure falls back to the Triton kernel with one log
line; `auto` takes FlashInfer only where it imports on a CUDA device."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from omnistage.services.thinker.kernels import flashinfer_attention
from omnistage.services.thinker.kernels.flashinfer_attention import kv_layout
from omnistage.services.thinker.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    attention_metadata,
)
from omnistage.services.thinker.models.layers.backends import Backends, FlashInferAttention, resolve_backends

from tests.services.thinker.kernels.test_prefill_kernel import DIM, cache_layer, step_layout

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


class PagedPrefillWrapper:
    """What FlashInfer's paged prefill computes, from the arguments its docs name."""

    plans = 0

    def __init__(self, workspace: torch.Tensor, kv_layout: str = "NHD", backend: str = "auto") -> None:
        assert kv_layout == "NHD" and workspace.numel() > 0 and backend == "auto"

    def plan(self, qo, kv, indices, last, num_qo_heads, num_kv_heads, head_dim, page, **kw) -> None:
        assert kw["causal"] and qo.dtype == kv.dtype == indices.dtype == last.dtype == torch.int32
        assert all(t.device.type == "cpu" for t in (qo, kv, indices, last))  # host: no GPU wait
        PagedPrefillWrapper.plans += 1
        self.layout = (qo, kv, indices, last, num_qo_heads, num_kv_heads, page, kw["sm_scale"])

    def run(self, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        qo, kv, indices, last, heads, kv_heads, page, scale = self.layout
        k_cache, v_cache = cache
        out = torch.empty_like(q)
        for i in range(qo.numel() - 1):
            pages = indices[kv[i] : kv[i + 1]].long()
            kv_len = (pages.numel() - 1) * page + int(last[i])
            k = k_cache[pages].reshape(-1, kv_heads, q.shape[-1])[:kv_len]
            v = v_cache[pages].reshape(-1, kv_heads, q.shape[-1])[:kv_len]
            rows = q[qo[i] : qo[i + 1]]
            k, v = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
            scores = torch.einsum("qhd,khd->hqk", rows, k) * scale
            qpos = torch.arange(rows.shape[0])[:, None] + kv_len - rows.shape[0]
            scores.masked_fill_(torch.arange(kv_len)[None, :] > qpos, float("-inf"))
            out[qo[i] : qo[i + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        return out


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = PagedPrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(flashinfer_attention.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(flashinfer_attention, "DTYPES", (torch.float32,))  # the stand-in runs fp32
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "H200")
    PagedPrefillWrapper.plans = 0
    return module


def mixed_step(
    seed: int,
) -> tuple[PagedAttention, AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk over a cached prefix, a whole prompt and two decode rows; q, k, v of their new tokens."""
    query_lens, context_lens = [5, 40, 1, 1], [70, 40, 9, 130]
    layer = cache_layer(8, 2, seed)
    tables, slots = step_layout(query_lens, context_lens)
    t = sum(query_lens)
    md = AttentionMetadata(query_lens, context_lens, slots, tables, host_block_tables=tables)
    return layer, md, torch.randn(t, 8, DIM), torch.randn(t, 2, DIM), torch.randn(t, 2, DIM)


def reference(layer: PagedAttention, md: AttentionMetadata, q, k, v) -> tuple[torch.Tensor, ...]:
    ref = PagedAttention(layer.num_heads, layer.num_kv_heads, DIM, layer.scale)
    ref.k_cache, ref.v_cache = layer.k_cache.clone(), layer.v_cache.clone()
    plain = AttentionMetadata(md.query_lens, md.context_lens, md.slot_mapping, md.block_tables)
    with attention_metadata(plain):
        return ref(q, k, v), ref.k_cache


def test_the_layout_handed_to_flashinfer_is_each_sequence_pages_and_last_fill():
    tables = torch.tensor([[7, 3, 9], [4, -1, -1], [2, 6, -1]])
    qo, kv, indices, last = kv_layout([5, 1, 16], [40, 1, 32], tables, page=16)
    assert qo.tolist() == [0, 5, 6, 22]
    assert kv.tolist() == [0, 3, 4, 6]
    assert indices.tolist() == [7, 3, 9, 4, 2, 6]
    assert last.tolist() == [8, 1, 16]


def test_flashinfer_prefill_equals_the_reference_and_plans_once_per_step(fake_flashinfer):
    layer, md, q, k, v = mixed_step(seed=3)
    want, want_cache = reference(layer, md, q, k, v)
    layer.backend = FlashInferAttention()
    with attention_metadata(md):
        got = layer(q, k, v)
        again = layer(q, k, v)  # a second layer of the same step reuses the plan
    assert PagedPrefillWrapper.plans == 1
    assert torch.equal(layer.k_cache, want_cache)  # the K/V writes are the Triton kernel's
    assert ((got - want).norm() / want.norm()) < 1e-5 and torch.equal(got, again)


def test_a_failing_plan_falls_back_to_the_triton_kernel_with_one_log_line(fake_flashinfer, caplog):
    def broken(self, *args, **kw):
        raise RuntimeError("ninja: build stopped: subcommand failed")

    fake_flashinfer.BatchPrefillWithPagedKVCacheWrapper.plan = broken
    backend = FlashInferAttention()
    outputs = []
    with caplog.at_level(logging.WARNING):
        for seed in (4, 5):
            layer, md, q, k, v = mixed_step(seed)
            want, _ = reference(layer, md, q, k, v)
            layer.backend = backend
            with attention_metadata(md):
                outputs.append((layer(q, k, v), want))
    lines = [r.getMessage() for r in caplog.records if "FlashInfer" in r.getMessage()]
    assert len(lines) == 1 and "build stopped" in lines[0] and "Triton" in lines[0]
    assert all(((got - want).norm() / want.norm()) < 1e-5 for got, want in outputs)


def test_fp32_is_refused_by_flashinfer_and_served_by_triton(fake_flashinfer, monkeypatch, caplog):
    monkeypatch.setattr(flashinfer_attention, "DTYPES", (torch.float16, torch.bfloat16))
    layer, md, q, k, v = mixed_step(seed=6)
    want, _ = reference(layer, md, q, k, v)
    layer.backend = FlashInferAttention()
    with caplog.at_level(logging.WARNING), attention_metadata(md):
        got = layer(q, k, v)
    assert PagedPrefillWrapper.plans == 0 and "fp16/bf16" in caplog.text
    assert ((got - want).norm() / want.norm()) < 1e-5


def test_auto_takes_flashinfer_where_it_imports_on_cuda(fake_flashinfer, monkeypatch):
    monkeypatch.setattr("omnistage.services.thinker.models.layers.backends.triton_available", lambda: True)
    assert resolve_backends("auto", "auto", CUDA, 16, 128) == Backends("flashinfer", "triton")
    assert resolve_backends("flashinfer", "auto", CUDA, 16, 128).graph_safe  # decode stays Triton
    assert resolve_backends("triton", "auto", CUDA, 16, 128) == Backends("triton", "triton")
    assert resolve_backends("auto", "auto", CPU, 16, 128) == Backends("torch", "torch")


def test_an_asked_flashinfer_that_cannot_run_falls_back_with_a_log_line(monkeypatch, caplog):
    monkeypatch.setattr("omnistage.services.thinker.models.layers.backends.triton_available", lambda: True)
    monkeypatch.setattr(flashinfer_attention.importlib.util, "find_spec", lambda name: None)
    with caplog.at_level(logging.INFO):
        assert resolve_backends("flashinfer", "auto", CUDA, 16, 128) == Backends("triton", "triton")
        assert resolve_backends("auto", "auto", CUDA, 16, 128) == Backends("triton", "triton")
        assert resolve_backends("flashinfer", "torch", CPU, 16, 128) == Backends("torch", "torch")
    assert "not installed" in caplog.text
