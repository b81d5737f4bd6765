"""The weights-first projection (`kernels/resident_gemv.py`) equals F.linear, and with the add + RMSNorm
folded in equals `norms.rms_norm` then F.linear (its residual sum bit for bit); the dispatch rule
serves one or two tokens of a weight that fits and nothing else; installing reaches the qkv
projection's norm and every projection, and not with RESIDENT_ENV off; and the tiny engine with it
(one sequence: a two-token prefill — the first layer's norm without a residual — and decode steps
through the graph buffers) gives the reference's greedy tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import resident_gemv as resident
from omnistage.services.thinker.kernels.norms import rms_norm
from omnistage.services.thinker.kernels.resident_gemv import ResidentConfig, chooses_kernel, resident_gemv
from omnistage.services.thinker.models.layers.backends import (
    QKV_ROPE_ENV,
    RESIDENT_ENV,
    Backends,
    install_backends,
)

from tests.services.thinker.kernels.fast_engine import fast_engine


@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 50, 300, ResidentConfig(block_n=16, warps=4)),  # N not a multiple of the rows, K not a power of 2
        (2, 24, 64, ResidentConfig(block_n=8, warps=2)),
        (1, 3, 128, None),  # fewer weight rows than a program's
    ],
)
def test_fp32_equals_f_linear(m, n, k, config):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = resident_gemv(x, w, config=config)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.allclose(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_folded_norm_equals_rms_norm_then_the_projection(dtype, with_residual):
    torch.manual_seed(1)
    m, n, k = 2, 40, 96
    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype) * 0.1
    residual, norm_w = torch.randn(m, k, dtype=dtype), torch.randn(k, dtype=dtype)
    if with_residual:
        got, total = resident_gemv(x, w, norm=(norm_w, 1e-6), residual=residual)
        normed, want_total = rms_norm(x, norm_w, 1e-6, residual)
        assert torch.equal(total, want_total)  # the residual stream, bit for bit
    else:
        got = resident_gemv(x, w, norm=(norm_w, 1e-6))
        normed = rms_norm(x, norm_w, 1e-6)
    want = F.linear(normed.float(), w.float())
    tol = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=2e-2, atol=5e-2)
    assert torch.allclose(got.float(), want, **tol)


def test_a_residual_without_a_norm_is_refused():
    with pytest.raises(ValueError, match="only added before a norm"):
        resident_gemv(torch.randn(1, 8), torch.randn(4, 8), residual=torch.randn(1, 8))


def test_the_same_inputs_give_the_same_bits():
    torch.manual_seed(2)
    x, w, nw, r = torch.randn(1, 200), torch.randn(30, 200), torch.randn(200), torch.randn(1, 200)
    a = resident_gemv(x, w, norm=(nw, 1e-6), residual=r)
    b = resident_gemv(x, w, norm=(nw, 1e-6), residual=r)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_the_dispatch_rule(monkeypatch):
    w = torch.randn(8, 32)
    assert chooses_kernel(torch.randn(1, 32), w)  # interpreting: the CPU counts
    assert chooses_kernel(torch.randn(2, 32), w)
    assert not chooses_kernel(torch.randn(3, 32), w)  # three tokens: the other kernels
    assert not chooses_kernel(torch.randn(0, 32), w)
    assert not chooses_kernel(torch.randn(1, 32).bfloat16(), w)  # mixed dtypes
    assert not chooses_kernel(torch.randn(1, 32), torch.randn(32, 8).t())  # a transposed weight
    monkeypatch.setattr(resident, "_RESIDENT_BYTES", 8 * 32 * 4 - 1)  # a weight too large to be resident
    assert not chooses_kernel(torch.randn(1, 32), w)
    assert resident.normed_linear(torch.randn(1, 32), w, torch.randn(32), 1e-6, None) is None


def test_linear_falls_back_where_the_kernel_does_not_serve():
    w = torch.randn(8, 32)
    calls = []
    fallback = lambda x, weight: calls.append(x.shape) or F.linear(x, weight)  # noqa: E731
    x3 = torch.randn(3, 32)
    assert torch.allclose(resident.linear(x3, w, fallback), F.linear(x3, w))
    assert calls == [(3, 32)]
    x1 = torch.randn(1, 1, 32)  # a leading shape kept
    assert torch.allclose(resident.linear(x1, w, fallback), F.linear(x1, w), atol=1e-5)
    assert calls == [(3, 32)]


def _projections(model):
    from omnistage.services.thinker.models.layers.linear import QKVParallelLinear, RowParallelLinear

    qkv = [m for m in model.modules() if isinstance(m, QKVParallelLinear)]
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    return qkv, rows


def test_install_reaches_the_qkv_norm_and_the_projections_unless_switched_off(tiny_model, monkeypatch):
    monkeypatch.delenv(RESIDENT_ENV, raising=False)
    monkeypatch.delenv(QKV_ROPE_ENV, raising=False)  # the epilogue off by default
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    qkv, rows = _projections(tiny_model)
    assert qkv and all(m.norm_gemv is resident.normed_linear and m.rope_gemv is None for m in qkv)
    monkeypatch.setenv(QKV_ROPE_ENV, "on")
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.rope_gemv is resident.normed_qkv_rope for m in qkv)
    assert rows and all(m.gemv is not None and m.gemv.func is resident.linear for m in rows)
    install_backends(tiny_model, Backends("triton", "triton"), fuse=False)  # the unfused comparison
    assert all(m.norm_gemv is None and m.rope_gemv is None for m in qkv) and all(m.gemv is None for m in rows)
    monkeypatch.setenv(QKV_ROPE_ENV, "off")  # the epilogue's same-build comparison: the rest stays
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.norm_gemv is resident.normed_linear and m.rope_gemv is None for m in qkv)
    monkeypatch.setenv(QKV_ROPE_ENV, "on")
    monkeypatch.setenv(RESIDENT_ENV, "off")
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.norm_gemv is None and m.rope_gemv is None for m in qkv) and all(m.gemv is None for m in rows)
    install_backends(tiny_model, Backends("torch", "torch"))
    assert all(m.norm_gemv is None and m.rope_gemv is None for m in qkv)


@pytest.fixture
def tiny_model(tiny_ckpt_2_layers):
    from omnistage.services.thinker.models.loader import load_model

    return load_model(str(tiny_ckpt_2_layers), dtype=torch.float32, device="cpu")


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [[17, 404]]  # two tokens: a prefill the kernel serves, then one-sequence decode steps


def test_tiny_engine_with_the_weights_first_projections_equals_the_reference(tiny_ckpt_2_layers, monkeypatch):
    reference = rank0_engine(
        start_rank(RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False))
    )
    want = [r.token_ids for r in reference.generate(PROMPT, PARAMS)]
    monkeypatch.delenv(RESIDENT_ENV, raising=False)
    monkeypatch.setenv(QKV_ROPE_ENV, "on")
    launches = []  # (weight, rows, folded norm, residual given, QK-norm + rope epilogue) of each launch
    kernel = resident.resident_gemv

    def counted(x, w, norm=None, residual=None, config=None, rope=None):
        launches.append((w.data_ptr(), x.shape[0], norm is not None, residual is not None, rope is not None))
        return kernel(x, w, norm, residual, config, rope)

    monkeypatch.setattr(resident, "resident_gemv", counted)
    engine = fast_engine(tiny_ckpt_2_layers, ENGINE_CFG)
    runner = engine.runner
    got = [r.token_ids for r in engine.generate(PROMPT, PARAMS)]
    assert got == want
    names = {m.weight.data_ptr(): name for name, m in runner.model.named_modules() if hasattr(m, "weight")}
    seen = [(names[w].removeprefix("model."), *rest) for w, *rest in launches]
    attention = [s for s in seen if ".attention." in s[0]]

    # The prefill: the first layer's qkv with its norm and no residual, then its o; the second's qkv
    # with both, then its o. Each decode step the same at one row (a bucket of one). The qkv's q and
    # k QK-normed and roped in its launch where the attention would launch that apart: the prefill;
    # not the decode steps here (under the interpreter the decode attention folds it: one split).
    def expect(rows: int, rope: bool) -> list[tuple]:
        return [
            ("layers.0.attention.query_key_value", rows, True, False, rope),
            ("layers.0.attention.dense", rows, False, False, False),
            ("layers.1.attention.query_key_value", rows, True, True, rope),
            ("layers.1.attention.dense", rows, False, False, False),
        ]

    assert attention[:4] == expect(2, True)
    decode = attention[4:]
    assert len(decode) == 4 * (PARAMS.max_tokens - 1) and decode == expect(1, False) * (PARAMS.max_tokens - 1)
    # The dense MLP, the folded-in shared expert's and the LM head's small weights take it too.
    assert any(".mlp." in s[0] for s in seen) and any("lm_head" in s[0] for s in seen)
