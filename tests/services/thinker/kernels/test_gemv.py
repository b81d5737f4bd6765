"""The small-batch GEMV in Triton equals F.linear (fp32, split over K or not), the one dispatch
rule picks it only where it serves, and installing reaches every projection and the LM head. The
tiny engine's greedy tokens with it on are test_decode_graphs.py's (one interpreted engine run
shared with the fusions-off case)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.services.thinker.kernels import gemv as gemv_kernels
from omnistage.services.thinker.kernels.gemv import GemvConfig, chooses_kernel, default_config, gemv, linear
from omnistage.services.thinker.models.layers.backends import (
    GEMV_ENV,
    RESIDENT_ENV,
    BackendError,
    Backends,
    install_backends,
)


@pytest.mark.parametrize(
    "m,n,k,config",
    [
        (1, 50, 300, GemvConfig(block_n=16, block_k=64)),  # N and K not multiples of the blocks
        (3, 70, 512, GemvConfig(block_n=32, block_k=128, split=2)),
        (16, 33, 200, GemvConfig(block_n=16, block_k=64, split=3)),  # the last split shorter
        (5, 24, 96, GemvConfig(block_n=16, block_k=64, split=8)),  # more splits asked than K tiles
        (2, 40, 1024, None),  # the default config (splits: 2 row blocks are far from filling the SMs)
    ],
)
def test_fp32_equals_f_linear(m, n, k, config):
    torch.manual_seed(m * n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    got = gemv(x, w, config)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    assert torch.allclose(got, F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_split_k_sums_in_a_fixed_order():
    torch.manual_seed(0)
    x, w = torch.randn(4, 777), torch.randn(20, 777)
    cfg = GemvConfig(block_n=16, block_k=64, split=4)
    assert torch.equal(gemv(x, w, cfg), gemv(x, w, cfg))


def test_the_default_config_splits_k_only_while_the_row_blocks_leave_sms_idle():
    assert default_config(2048, 2048).split > 1  # Ling-mini's o_proj: 64 row blocks
    assert default_config(157184, 2048).split == 1  # the LM head: thousands of row blocks
    assert default_config(64, 256).split == 1  # K too short for two tiles a split


def test_the_dispatch_rule(monkeypatch):
    w = torch.randn(8, 32)
    assert chooses_kernel(torch.randn(16, 32), w)  # interpreting: the CPU counts
    assert chooses_kernel(torch.randn(2, 8, 32), w)  # 16 rows in any leading shape
    assert not chooses_kernel(torch.randn(17, 32), w)  # a prefill's rows: cuBLAS
    assert not chooses_kernel(torch.randn(0, 32), w)
    assert not chooses_kernel(torch.randn(2, 32, dtype=torch.float64), w.double())
    assert not chooses_kernel(torch.randn(2, 32).bfloat16(), w)  # mixed dtypes
    assert not chooses_kernel(torch.randn(2, 32), torch.randn(32, 8).t())  # a transposed weight
    monkeypatch.setitem(gemv_kernels.CONFIGS, (8, 32), GemvConfig(max_tokens=4))  # cuBLAS wins from 5
    assert chooses_kernel(torch.randn(4, 32), w) and not chooses_kernel(torch.randn(5, 32), w)
    monkeypatch.setitem(gemv_kernels.CONFIGS, (8, 32), GemvConfig(max_tokens=0))  # cuBLAS always
    assert not chooses_kernel(torch.randn(1, 32), w)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not chooses_kernel(torch.randn(2, 32), torch.randn(9, 32))  # a CPU, no interpreter: F.linear


def test_linear_keeps_the_leading_shape_and_falls_back_above_the_tokens(monkeypatch):
    calls = []
    kernel = gemv_kernels.gemv
    monkeypatch.setattr(gemv_kernels, "gemv", lambda x, w: calls.append(x.shape[0]) or kernel(x, w))
    w = torch.randn(12, 40)
    small, big = torch.randn(2, 3, 40), torch.randn(20, 40)
    assert torch.allclose(linear(small, w), F.linear(small, w), atol=1e-5)
    assert torch.equal(linear(big, w), F.linear(big, w))
    assert calls == [6]


def _projections(model):
    return [m for m in model.modules() if hasattr(m, "gemv")]


def test_installing_reaches_the_projections_and_the_lm_head_when_switched_on(tiny_ckpt, monkeypatch):
    from omnistage.services.thinker.models.layers.embed_head import ParallelLMHead
    from omnistage.services.thinker.models.layers.linear import QKVParallelLinear, RowParallelLinear
    from omnistage.services.thinker.models.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32, device="cpu")
    mods = _projections(model)
    kinds = {type(m) for m in mods}
    assert {ParallelLMHead, QKVParallelLinear, RowParallelLinear} <= kinds
    monkeypatch.setenv(RESIDENT_ENV, "off")  # this switch alone (test_resident_gemv.py: the other)
    monkeypatch.delenv(GEMV_ENV, raising=False)
    install_backends(model, Backends("triton", "triton"))
    assert all(m.gemv is None for m in mods)  # off unless asked (slower end to end on one H200)
    monkeypatch.setenv(GEMV_ENV, "on")
    install_backends(model, Backends("triton", "triton"))
    assert all(m.gemv is linear for m in mods)
    monkeypatch.setenv(GEMV_ENV, "off")
    install_backends(model, Backends("triton", "triton"))
    assert all(m.gemv is None for m in mods)
    monkeypatch.setenv(GEMV_ENV, "on")
    install_backends(model, Backends("torch", "triton"))  # the reference attention: no GEMV either
    assert all(m.gemv is None for m in mods)
    monkeypatch.setenv(GEMV_ENV, "yes")
    with pytest.raises(BackendError, match=f"{GEMV_ENV}='yes': expected on or off"):
        install_backends(model, Backends("triton", "triton"))


def test_on_a_gpu_only_the_measured_shapes_leave_cublas(monkeypatch):
    """The sweep measured cuBLAS faster for some shapes (max_tokens 0) and never saw others: on a GPU
    an unmeasured shape stays with cuBLAS; under the interpreter it gets the default tiling."""
    assert gemv_kernels.config_for(8, 32).max_tokens == gemv_kernels.MAX_TOKENS  # interpreting here
    monkeypatch.setattr(gemv_kernels, "interpreting", lambda: False)
    assert gemv_kernels.config_for(8, 32).max_tokens == 0
    assert gemv_kernels.config_for(157184, 2048).max_tokens == 8  # Ling-mini's LM head: measured faster
    assert gemv_kernels.config_for(3072, 2048).max_tokens == 0  # Ling-mini's qkv: cuBLAS measured faster
