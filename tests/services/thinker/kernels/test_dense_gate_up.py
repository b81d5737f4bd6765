"""The dense MLP's gate-up + SiLU·mul in one streaming launch (`kernels/dense_gate_up.py`) equals
silu(x @ Wgᵀ) · (x @ Wuᵀ) (fp32 tightly, bf16 within its roundings) at one and two tokens, tiles that
do not divide the intermediate size and programs that loop over several tiles; gives the same bits
whatever program computes a tile and launch after launch; a TP rank's shard gives the full
weight's columns bit for bit, and the sharded MLP the unsharded one's sum; the dispatch rule takes
one or two tokens of a supported weight and nothing else; installing reaches every GatedMLP unless
the fusions or DENSE_GATEUP_ENV are off; and the tiny engine's greedy tokens are the same with the
switch on (the launch taken at the prefill's two tokens and each decode step) as off."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.kernels import dense_gate_up as dense
from omnistage.services.thinker.kernels.dense_gate_up import DenseTiles, chooses_kernel, silu_gate_up
from omnistage.services.thinker.models.layers.backends import (
    DENSE_GATEUP_ENV,
    BackendError,
    Backends,
    dense_gateup_enabled,
    install_backends,
)
from omnistage.services.thinker.models.layers.moe import GatedMLP
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
    install_backends(tiny_model, Backends("triton", "triton"), fuse=False)  # the unfused comparison
    assert all(m.gate_up_act is None for m in mlps)
    monkeypatch.setenv(DENSE_GATEUP_ENV, "off")
    install_backends(tiny_model, Backends("triton", "triton"), fuse=True)
    assert all(m.gate_up_act is None and m.act is not None for m in mlps)
    monkeypatch.delenv(DENSE_GATEUP_ENV)
    install_backends(tiny_model, Backends("torch", "torch"))
    assert all(m.gate_up_act is None for m in mlps)


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [[17, 404]]  # two tokens: a prefill the kernel serves, then one-sequence decode steps


def _tokens(ckpt, monkeypatch, switch: str, launches: list) -> list[list[int]]:
    """The fast engine's greedy tokens with DENSE_GATEUP_ENV at `switch`, decode steps through the
    graph buffers; each kernel launch's token count appended to `launches`."""
    monkeypatch.setenv(DENSE_GATEUP_ENV, switch)

    def counted(x, gate_up, tiles=None):
        launches.append(x.shape[0])
        return silu_gate_up(x, gate_up, tiles)  # the module's, as imported above

    monkeypatch.setattr(dense, "silu_gate_up", counted)
    engine = fast_engine(ckpt, ENGINE_CFG)
    return [r.token_ids for r in engine.generate(PROMPT, PARAMS)]


def test_tiny_engine_gives_the_same_greedy_tokens_with_the_switch_on_and_off(tiny_ckpt_2_layers, monkeypatch):
    off: list[int] = []
    want = _tokens(tiny_ckpt_2_layers, monkeypatch, "off", off)
    on: list[int] = []
    assert _tokens(tiny_ckpt_2_layers, monkeypatch, "on", on) == want
    assert off == []
    # The dense layer's: the prompt's two tokens, then a token each decode step (the shared expert
    # runs in the routed experts' launches, not through its GatedMLP).
    assert on == [2] + [1] * (PARAMS.max_tokens - 1)
