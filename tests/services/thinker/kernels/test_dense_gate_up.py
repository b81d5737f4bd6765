"""The dense MLP's gate-up + SiLU·mul in one streaming launch (`kernels/dense_gate_up.py`) equals
silu(x @ Wgᵀ) · (x @ Wuᵀ) (fp32 tightly, bf16 within its roundings) at one and two tokens, tiles that
do not divide the intermediate size and programs that loop over several tiles; gives the same bits
whatever program computes a tile and launch after launch; a TP rank's shard gives the full
weight's columns bit for bit, and the sharded MLP the unsharded one's sum; the dispatch rule takes
one or two tokens of a supported weight and nothing else; installing reaches every GatedMLP unless
the fusions or DENSE_GATEUP_ENV are off. With the add + RMSNorm before it folded in
(`normed_gate_up_act`) the launch is `norms.rms_norm` then the launch bit for bit (fp32 and bf16,
its residual sum too, one and two tokens, a TP rank's shard: each rank norms the whole row), program
0 alone storing the sum; the fold serves one token; `GatedMLP.normed` with it equals it without; and
the tiny engine's greedy tokens are the reference's with the switch on (the launch taken at the
prefill's two tokens and, the norm folded in, each decode step: one RMSNorm launch a step fewer)
and off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import dense_gate_up as dense
from omnistage.services.thinker.kernels import norms
from omnistage.services.thinker.kernels.dense_gate_up import DenseTiles, chooses_kernel, silu_gate_up
from omnistage.services.thinker.kernels.norms import rms_norm
from omnistage.services.thinker.models.layers.backends import (
    DENSE_GATEUP_ENV,
    BackendError,
    Backends,
    dense_gateup_enabled,
    install_backends,
)
from omnistage.services.thinker.models.layers.moe import GatedMLP
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup

from tests.services.thinker.kernels.fast_engine import fast_engine


def _case(m: int, inter: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden, generator=g).to(dtype)
    return x, (torch.randn(2 * inter, hidden, generator=g) * 0.1).to(dtype)


def _reference(x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    """GatedMLP's reference activation: the projection in x's dtype, then silu(gate) * up."""
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize(
    "m,inter,hidden,tiles",
    [
        (1, 37, 96, None),  # the default tiles: 2 rows (19 tiles, the last half full), 4 programs
        (2, 37, 96, None),
        (1, 40, 64, DenseTiles(rows=2, programs=3)),  # 20 tiles: programs of 7, 7 and 6
        (2, 33, 200, DenseTiles(rows=4, programs=5, warps=2)),  # hidden not a power of two
        (2, 5, 128, DenseTiles(rows=2, programs=16)),  # more programs than tiles: the rest have none
        (1, 1, 32, DenseTiles(rows=1, programs=1)),  # one row, one program
    ],
)
def test_fp32_equals_the_reference(m, inter, hidden, tiles):
    x, w = _case(m, inter, hidden, torch.float32, seed=m * inter + hidden)
    got = silu_gate_up(x, w, tiles)
    assert got.dtype == torch.float32 and got.shape == (m, inter)
    assert torch.allclose(got, _reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 2])
def test_bf16_is_the_reference_within_its_roundings(m):
    x, w = _case(m, 45, 256, torch.bfloat16, seed=m)
    got = silu_gate_up(x, w)
    assert got.dtype == torch.bfloat16
    # (the interpreter's casts to bf16 truncate: the roundings themselves are the GPU test's,
    # tests/services/thinker/engine/test_dense_gate_up_gpu.py)
    assert torch.allclose(got.float(), _reference(x, w).float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 2])
def test_the_same_bits_whatever_program_computes_a_tile_and_launch_after_launch(m):
    x, w = _case(m, 50, 160, torch.float32, seed=3)
    first = silu_gate_up(x, w, DenseTiles(rows=2, programs=1))
    for programs in (1, 3, 7, 25, 40):
        assert torch.equal(silu_gate_up(x, w, DenseTiles(rows=2, programs=programs)), first)


@pytest.mark.parametrize("tp", [2, 4])
def test_a_tp_ranks_shard_gives_the_full_weights_columns_bit_for_bit(tp):
    inter, hidden = 24, 64
    x, full = _case(2, inter, hidden, torch.float32, seed=tp)
    want = silu_gate_up(x, full, DenseTiles(rows=2, programs=4))
    gate, up = full[:inter], full[inter:]
    n = inter // tp
    for rank in range(tp):
        mlp = GatedMLP(hidden, inter, TPGroup(rank, tp), reduce=False)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
        got = silu_gate_up(x, mlp.gate_up_proj.weight, DenseTiles(rows=2, programs=3))
        assert torch.equal(got, want[:, rank * n : (rank + 1) * n])


def test_the_sharded_mlp_with_the_kernel_sums_to_the_unsharded_reference():
    torch.manual_seed(4)
    inter, hidden, tp = 32, 48, 2
    gate, up, down = (
        torch.randn(inter, hidden) * 0.1,
        torch.randn(inter, hidden) * 0.1,
        torch.randn(hidden, inter),
    )
    x = torch.randn(1, hidden)
    parts = []
    for rank in range(tp):
        mlp = GatedMLP(hidden, inter, TPGroup(rank, tp), reduce=False)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
        mlp.down_proj.weight_loader(mlp.down_proj.weight, down)
        reference = mlp(x)
        mlp.gate_up_act = dense.gate_up_act
        parts.append(mlp(x))
        assert torch.allclose(parts[-1], reference, rtol=1e-5, atol=1e-5)
    want = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    assert torch.allclose(sum(parts), want, rtol=1e-4, atol=1e-4)


def test_the_dispatch_rule(monkeypatch):
    w = torch.randn(16, 32)
    assert chooses_kernel(torch.randn(1, 32), w)  # interpreting: the CPU counts
    assert chooses_kernel(torch.randn(2, 32), w)
    assert chooses_kernel(torch.randn(1, 1, 32), w)  # a leading shape: its rows count
    assert not chooses_kernel(torch.randn(3, 32), w)  # three tokens: cuBLAS, then the SiLU·mul
    assert not chooses_kernel(torch.randn(0, 32), w)
    assert not chooses_kernel(torch.randn(1, 32).bfloat16(), w)  # mixed dtypes
    assert chooses_kernel(torch.randn(1, 32).half(), w.half())  # fp16 serves
    assert not chooses_kernel(torch.randn(1, 32).double(), w.double())  # a dtype it does not take
    assert not chooses_kernel(torch.randn(1, 32), torch.randn(32, 16).t())  # a transposed weight
    assert not chooses_kernel(torch.randn(1, 32), torch.randn(15, 32))  # not gate and up rows
    assert not chooses_kernel(torch.randn(1, 16), w)  # another width
    monkeypatch.setattr(dense, "_PROGRAM_BYTES", 4 * 32 * 4 - 1)  # not even a row fits a program
    assert dense.tile_rows(32, 4) == 0
    assert not chooses_kernel(torch.randn(1, 32), w)
    assert dense.gate_up_act(torch.randn(1, 32), w) is None


def test_the_activation_keeps_a_leading_shape_and_refuses_more_tokens():
    x, w = _case(2, 12, 64, torch.float32)
    got = dense.gate_up_act(x[:, None, :], w)
    assert got.shape == (2, 1, 12) and torch.equal(got[:, 0], silu_gate_up(x, w))
    assert dense.gate_up_act(torch.randn(3, 64), w) is None
    with pytest.raises(ValueError, match="3 tokens, at most 2"):
        silu_gate_up(torch.randn(3, 64), w)


@pytest.mark.parametrize(
    "hidden,inter,tokens,want",
    [
        (2048, 5120, 1, DenseTiles(2, 4 * 132, 4)),  # Ling-mini: 32 KiB a program, 4 an SM
        (2048, 5120, 2, DenseTiles(2, 4 * 132, 4)),
        (4096, 4608, 1, DenseTiles(2, 2 * 132, 4)),  # Ming-flash TP=2: 64 KiB a program, 2 an SM
        (4096, 4608, 2, DenseTiles(2, 2 * 132, 8)),  # two rows of 4096: 8 warps (4 spill)
        (2048, 3, 1, DenseTiles(2, 2, 4)),  # no more programs than tiles
    ],
)
def test_the_default_tiles(hidden, inter, tokens, want):
    assert dense.default_tiles(hidden, inter, 2, sms=132, tokens=tokens) == want


def test_the_switch_takes_on_or_off_only(monkeypatch):
    monkeypatch.delenv(DENSE_GATEUP_ENV, raising=False)
    assert dense_gateup_enabled()
    monkeypatch.setenv(DENSE_GATEUP_ENV, "OFF")
    assert not dense_gateup_enabled()
    monkeypatch.setenv(DENSE_GATEUP_ENV, "1")
    with pytest.raises(BackendError, match="OMNISTAGE_THINKER_DENSE_GATEUP='1': expected on or off"):
        dense_gateup_enabled()


@pytest.fixture
def tiny_model(tiny_ckpt_2_layers):
    from omnistage.services.thinker.models.loader import load_model

    return load_model(str(tiny_ckpt_2_layers), dtype=torch.float32, device="cpu")


def test_install_reaches_every_gated_mlp_unless_switched_off(tiny_model, monkeypatch):
    monkeypatch.delenv(DENSE_GATEUP_ENV, raising=False)
    mlps = [m for m in tiny_model.modules() if isinstance(m, GatedMLP)]
    assert len(mlps) == 2  # the dense layer's and the MoE layer's shared expert
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.gate_up_act is dense.gate_up_act for m in mlps)
    assert all(m.norm_gate_up_act is dense.normed_gate_up_act for m in mlps)
    install_backends(tiny_model, Backends("triton", "triton"), fuse=False)  # the unfused comparison
    assert all(m.gate_up_act is None and m.norm_gate_up_act is None for m in mlps)
    monkeypatch.setenv(DENSE_GATEUP_ENV, "off")
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.gate_up_act is None and m.norm_gate_up_act is None and m.act is not None for m in mlps)
    monkeypatch.delenv(DENSE_GATEUP_ENV)
    install_backends(tiny_model, Backends("torch", "torch"))
    assert all(m.gate_up_act is None and m.norm_gate_up_act is None for m in mlps)


def _normed_case(m: int, hidden: int, dtype: torch.dtype, seed: int):
    """x, the residual and a norm weight about 1 (the post-attention norm's)."""
    g = torch.Generator().manual_seed(seed)
    x, residual = torch.randn(m, hidden, generator=g), torch.randn(m, hidden, generator=g)
    return x.to(dtype), residual.to(dtype), (torch.rand(hidden, generator=g) + 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(
    "m,inter,hidden,tiles",
    [
        (1, 37, 96, DenseTiles(rows=2, programs=4)),
        (2, 37, 96, DenseTiles(rows=2, programs=4)),
        (2, 33, 200, DenseTiles(rows=4, programs=5, warps=2)),  # hidden not a power of two
        (1, 5, 128, DenseTiles(rows=2, programs=16)),  # more programs than tiles
    ],
)
def test_the_folded_norm_is_rms_norm_then_the_launch_bit_for_bit(
    dtype, with_residual, m, inter, hidden, tiles
):
    x, residual, norm_w = _normed_case(m, hidden, dtype, seed=m * inter + hidden)
    w = _case(m, inter, hidden, dtype, seed=hidden)[1]
    if with_residual:
        got, total = silu_gate_up(x, w, tiles, norm=(norm_w, 1e-6), residual=residual)
        normed, want_total = rms_norm(x, norm_w, 1e-6, residual)
        assert torch.equal(total, want_total)  # the residual stream, bit for bit
    else:
        got, normed = silu_gate_up(x, w, tiles, norm=(norm_w, 1e-6)), rms_norm(x, norm_w, 1e-6)
    assert got.dtype == dtype and torch.equal(got, silu_gate_up(normed, w, tiles))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tp", [2, 4])
def test_each_tp_rank_norms_the_whole_row_itself_and_keeps_its_residual_sum(dtype, tp):
    inter, hidden, m = 24, 64, 2
    x, residual, norm_w = _normed_case(m, hidden, dtype, seed=tp)
    full = _case(m, inter, hidden, dtype, seed=tp)[1]
    normed, want_total = rms_norm(x, norm_w, 1e-6, residual)
    want = silu_gate_up(normed, full, DenseTiles(rows=2, programs=4))
    gate, up = full[:inter], full[inter:]
    n = inter // tp
    for rank in range(tp):
        mlp = GatedMLP(hidden, inter, TPGroup(rank, tp), reduce=False).to(dtype)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, gate, 0)
        mlp.gate_up_proj.weight_loader(mlp.gate_up_proj.weight, up, 1)
        shard = mlp.gate_up_proj.weight
        got, total = silu_gate_up(x, shard, DenseTiles(rows=2, programs=3), (norm_w, 1e-6), residual)
        assert torch.equal(got, want[:, rank * n : (rank + 1) * n]) and torch.equal(total, want_total)


def test_program_0_alone_stores_the_residual_sum(monkeypatch):
    from triton.runtime import interpreter

    stores = []  # (program, the byte addresses it stored to)
    real = interpreter.InterpreterBuilder.create_masked_store

    def recorded(self, ptrs, value, mask, cache_policy):
        stores.append((self.grid_idx[0], ptrs.data[mask.data].copy()))
        return real(self, ptrs, value, mask, cache_policy)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", recorded)
    x, residual, norm_w = _normed_case(2, 64, torch.float32, seed=5)
    w = _case(2, 20, 64, torch.float32)[1]
    h, total = silu_gate_up(x, w, DenseTiles(rows=2, programs=4), (norm_w, 1e-6), residual)
    lo, hi = total.data_ptr(), total.data_ptr() + total.numel() * total.element_size()
    into_total = [(p, a) for p, a in stores if ((a >= lo) & (a < hi)).any()]
    assert [p for p, _ in into_total] == [0, 0]  # its two rows, nobody else's
    assert all(((a >= lo) & (a < hi)).all() for _, a in into_total)
    assert {p for p, _ in stores} == {0, 1, 2, 3}  # every program stored its h columns


def test_the_folds_dispatch_rule():
    x, residual, norm_w = _normed_case(1, 32, torch.float32, seed=6)
    w = torch.randn(16, 32)
    got, total = dense.normed_gate_up_act(x[None], w, norm_w, 1e-6, residual[None])  # a leading shape
    want, want_total = silu_gate_up(x, w, norm=(norm_w, 1e-6), residual=residual)
    assert got.shape == (1, 1, 8) and torch.equal(got[0], want)
    assert total.shape == (1, 1, 32) and torch.equal(total[0], want_total)
    got, same = dense.normed_gate_up_act(x, w, norm_w, 1e-6, None)  # no residual: x is the stream
    assert same is x and torch.equal(got, silu_gate_up(rms_norm(x, norm_w, 1e-6), w))
    assert dense.NORM_MAX_TOKENS == 1  # two tokens: the norm, then the launch (its registers)
    x2 = torch.randn(2, 32)
    assert dense.gate_up_act(x2, w) is not None
    assert dense.normed_gate_up_act(x2, w, norm_w, 1e-6, x2) is None
    assert dense.normed_gate_up_act(x, w, norm_w.double(), 1e-6, residual) is None  # the norm's dtype
    assert dense.normed_gate_up_act(x, w[:15], norm_w, 1e-6, residual) is None  # chooses_kernel's
    with pytest.raises(ValueError, match="only added before a norm"):
        silu_gate_up(x, w, residual=residual)


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_mlps_normed_with_the_fold_equals_it_without(tokens):
    torch.manual_seed(8)
    mlp = GatedMLP(48, 40, TPGroup())
    for p in mlp.parameters():
        p.data.normal_(0, 0.1)
    norm = RMSNorm(48)
    norm.weight.data += torch.rand(48)
    x, residual = torch.randn(tokens, 48), torch.randn(tokens, 48)
    norm.kernel, mlp.gate_up_act = rms_norm, dense.gate_up_act
    want, want_total = mlp.normed(x, residual, norm)  # the norm's launch, then the gate-up's
    calls = []
    mlp.norm_gate_up_act = lambda *a: calls.append(a[0].shape[0]) or dense.normed_gate_up_act(*a)
    got, total = mlp.normed(x, residual, norm)
    assert calls == [tokens]
    assert torch.equal(got, want) and torch.equal(total, want_total)
    norm.kernel = mlp.gate_up_act = mlp.norm_gate_up_act = None  # the reference: torch's ops
    reference, reference_total = mlp.normed(x, residual, norm)
    assert torch.equal(total, reference_total)
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-5)
    out, stream = mlp.normed(x, None, norm)  # the first layer's shape: no residual yet
    assert stream is x and torch.allclose(out, mlp(norm(x)))


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [[17, 404]]  # two tokens: a prefill the kernel serves, then one-sequence decode steps


@pytest.fixture(scope="module")
def reference_tokens(tiny_ckpt_2_layers):
    cfg = RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False)
    return [r.token_ids for r in rank0_engine(start_rank(cfg)).generate(PROMPT, PARAMS)]


def _tokens(ckpt, monkeypatch, switch: str, launches: list, norms_watched) -> tuple[list, list]:
    """The fast engine's greedy tokens with DENSE_GATEUP_ENV at `switch`, decode steps through the
    graph buffers; each kernel launch's (token count, whether it folds the norm) appended to
    `launches`; and each decode step's RMSNorm launches (their norm weights), from `norms_watched`
    (a `Launches` watching `_rms_norm_kernel`)."""
    monkeypatch.setenv(DENSE_GATEUP_ENV, switch)

    def counted(x, gate_up, tiles=None, norm=None, residual=None):
        launches.append((x.shape[0], norm is not None))
        return silu_gate_up(x, gate_up, tiles, norm, residual)  # the module's, as imported above

    monkeypatch.setattr(dense, "silu_gate_up", counted)
    engine = fast_engine(ckpt, ENGINE_CFG)
    model = engine.runner.model.model
    names = {model.layers[0].post_attention_layernorm.weight.data_ptr(): "dense post-attention"}
    names[model.norm.weight.data_ptr()] = "final"
    graphs, steps = engine.runner.graphs, []
    run = graphs.run

    def counted_run(plan, fill=None):
        before = len(norms_watched.arguments("_rms_norm_kernel"))
        out = run(plan, fill)
        weights = [args[2].data_ptr() for args in norms_watched.arguments("_rms_norm_kernel")[before:]]
        steps.append([names.get(w, "another") for w in weights])
        return out

    graphs.run = counted_run
    return [r.token_ids for r in engine.generate(PROMPT, PARAMS)], steps


def test_tiny_engine_gives_the_reference_tokens_with_the_switch_on_and_off_and_folds_a_norm(
    tiny_ckpt_2_layers, reference_tokens, monkeypatch, launches
):
    launches.watch(norms, "_rms_norm_kernel")
    off: list = []
    got_off, steps_off = _tokens(tiny_ckpt_2_layers, monkeypatch, "off", off, launches)
    on: list = []
    got_on, steps_on = _tokens(tiny_ckpt_2_layers, monkeypatch, "on", on, launches)
    assert got_on == got_off == reference_tokens
    assert off == []
    # The dense layer's: the prompt's two tokens (past NORM_MAX_TOKENS: the norm runs first), then
    # a token each decode step with its add + norm folded in (the shared expert runs in the routed
    # experts' launches, not through its GatedMLP).
    decode_steps = PARAMS.max_tokens - 1
    assert on == [(2, False)] + [(1, True)] * decode_steps
    # A decode step's RMSNorm launches: the dense layer's post-attention norm and the final norm
    # with the switch off, the final norm alone with it on (the qkv projections' input norms and the
    # MoE layer's post-attention norm fold either way).
    assert steps_off == [["dense post-attention", "final"]] * decode_steps
    assert steps_on == [["final"]] * decode_steps
