"""The router's gate GEMM in the selecting launch (ROUTE_TABLE's gemv path in token blocks, each
block's last program selecting its tokens; the tiled path's tensor-core dots, hidden splits summed
by the last program) equals the reference Router."""

from __future__ import annotations

import functools

import pytest
import torch
from omnistage.services.thinker.kernels import router as router_kernels
from omnistage.services.thinker.kernels.router import RouterTiles, route_path
from omnistage.services.thinker.kernels.tickets import tickets_for
from omnistage.services.thinker.models.layers.moe import Router


def _router(hidden: int, seed: int) -> Router:
    torch.manual_seed(seed)
    router = Router(hidden, 64, top_k=8, n_group=8, topk_group=4, scaling=2.5)
    router.weight.data.normal_()
    router.expert_bias.data.normal_(0, 0.1)
    return router


@pytest.mark.parametrize("tokens", [5, 8, 17, 33, 64, 130])
def test_the_tiled_gemm_routes_every_decode_batch_as_the_reference(tokens, monkeypatch):
    monkeypatch.setattr(router_kernels, "ROUTE_TABLE", ((256, "dot", 16),))  # the dot path at every T
    router = _router(72, tokens)  # 72: a partial hidden tile and an uneven split
    x = torch.randn(tokens, 72)
    want_w, want_ids = router(x)
    assert route_path(x, router.weight) == "dot"
    tiles = RouterTiles(block_e=16, block_k=16, split=2)
    router.kernel = functools.partial(router_kernels.route, tiles=tiles)
    for _ in range(2):  # the second launch reuses the tickets the first left
        got_w, got_ids = router(x)
        assert torch.equal(got_ids, want_ids)  # same experts in the same (descending) order
        assert torch.allclose(got_w, want_w, atol=1e-6)
    assert not tickets_for(x.device, 1).any()


@pytest.mark.parametrize("tokens,block_t", [(1, 1), (3, 1), (5, 2), (16, 4), (7, None)])
def test_the_gemv_path_in_small_token_blocks_routes_as_the_reference(tokens, block_t, monkeypatch):
    """Each token block's last program selects only its tokens: as many tickets as blocks, every
    one left at zero for the next launch."""
    router = _router(72, tokens)
    x = torch.randn(tokens, 72)
    want_w, want_ids = router(x)
    grids = []
    kernel = router_kernels._route_kernel

    class Recorded:
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(router_kernels, "_route_kernel", Recorded())
    monkeypatch.setattr(router_kernels, "ROUTE_TABLE", ((16, "gemv", 2),))  # block_t None: 2 a program
    router.kernel = functools.partial(router_kernels.route, block_t=block_t)
    for _ in range(2):  # the second launch reuses the tickets the first left
        got_w, got_ids = router(x)
        assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)
    rows = min(block_t or 2, 1 << (tokens - 1).bit_length())
    rows = 1 if rows == 2 else rows  # a block of two is never launched (it miscompiles on sm_90)
    assert grids == [(64 // router_kernels.gemv_block_e(rows, 72, 64), -(-tokens // rows), 1)] * 2
    assert not tickets_for(x.device, 1).any()


@pytest.mark.parametrize(
    "tiles",
    [RouterTiles(32, 32, 1), RouterTiles(16, 16, 4), RouterTiles(64, 128, 8)],
    ids=["one-split", "four-splits", "more-splits-than-tiles"],
)
def test_every_tiling_of_the_gemm_gives_the_same_routing(tiles):
    router = _router(72, 1)
    x = torch.randn(20, 72)
    want_w, want_ids = router(x)
    got_w, got_ids = router_kernels.route(x, router.weight, router.expert_bias, 8, 8, 4, 2.5, tiles=tiles)
    assert torch.equal(got_ids, want_ids) and torch.allclose(got_w, want_w, atol=1e-6)


def test_ties_on_the_tiled_path_go_to_the_lower_group_and_expert():
    router = Router(16, 64, top_k=8, n_group=8, topk_group=4, scaling=1.0)
    router.weight.data.zero_()  # every score 0.5: all groups and experts tie
    router.expert_bias.data.zero_()
    router.kernel = router_kernels.route
    w, ids = router(torch.randn(20, 16))
    assert ids.tolist() == [list(range(8))] * 20 and torch.allclose(w, torch.full_like(w, 1 / 8))


def test_the_path_by_token_count_dtype_and_fusion(monkeypatch):
    monkeypatch.setattr(router_kernels, "ROUTE_TABLE", ((4, "gemv", 1), (64, "dot", 16)))
    w = torch.zeros(64, 16)

    def path(tokens: int, dtype: torch.dtype = torch.float32, fuse: bool = True) -> str:
        return route_path(torch.zeros(tokens, 16, dtype=dtype), w.to(dtype), fuse)

    assert [path(t) for t in (1, 4, 5, 64, 65)] == ["gemv", "gemv", "dot", "dot", "cublas"]
    assert router_kernels._block_t("gemv", 3, None) == 1 and router_kernels._block_t("dot", 5, None) == 16
    assert router_kernels._block_t("gemv", 12, None) == 16  # forced past its rows: one block
    # Never a block of two tokens (duplicate experts on the H200, Triton 3.6): blocks of one instead.
    assert router_kernels._block_t("gemv", 2, None) == 1 and router_kernels._block_t("gemv", 8, 2) == 1
    assert path(8, fuse=False) == "cublas"  # the unfused comparison keeps the reference ops
    assert route_path(torch.zeros(8, 16, dtype=torch.bfloat16), w) == "cublas"  # mixed dtypes
    with pytest.raises(ValueError, match="router path 'nope'"):
        router_kernels.route(torch.zeros(8, 16), w, torch.zeros(64), 8, 8, 4, 1.0, path="nope")


def test_the_tiled_path_writes_no_fp32_copies_of_its_inputs(monkeypatch):
    """The decode step's casts are gone: no x.float() / weight.float() on the tiled path."""
    router = _router(32, 4)
    x = torch.randn(12, 32)
    calls = []
    real = torch.Tensor.float

    def spy(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "float", spy)
    router_kernels.route(x, router.weight, router.expert_bias, 8, 8, 4, 2.5)
    assert calls == []
    router_kernels.route(x, router.weight, router.expert_bias, 8, 8, 4, 2.5, path="cublas")
    assert calls == [(12, 32), (64, 32)]  # the reference GEMM's two casts, kept for a prefill


def test_a_gate_weight_with_strided_rows_is_refused_not_copied():
    """The gate weight is read before the PDL wait (pdl.STATIC_OPERANDS): a copy made for the
    launch could still be in flight then; a row-strided slice (a weight's columns) is kept as it is."""
    weight = torch.randn(64, 40)
    with pytest.raises(ValueError, match="rows must be contiguous"):
        router_kernels.route(torch.randn(2, 16), torch.randn(16, 64).t(), torch.zeros(64), 8, 8, 4, 1.0)
    sliced = weight[:, :32]  # rows 40 apart, each contiguous: read in place
    x = torch.randn(2, 32)
    want = router_kernels.route(x, sliced.contiguous(), torch.zeros(64), 8, 8, 4, 1.0)
    got = router_kernels.route(x, sliced, torch.zeros(64), 8, 8, 4, 1.0)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_a_gemv_program_reads_its_whole_hidden_row_in_one_chunk_where_it_can():
    """Ling-mini's row (2048) takes the default four experts a program, Ming-flash's rank (4096) two,
    more token rows fewer, never fewer than one."""
    block_e = router_kernels.gemv_block_e
    assert router_kernels.GEMV_TILES.block_e == 4
    assert [block_e(1, 2048, 256), block_e(1, 4096, 256), block_e(2, 4096, 256)] == [4, 2, 1]
    assert block_e(16, 8192, 256) == 1 and block_e(1, 64, 2) == 2
