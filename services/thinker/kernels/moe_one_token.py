"""The routed experts of one token (a decode step of one sequence) in two launches, without the
alignment: the gate-up launch reads the router's expert ids itself, and the down launch reads its
weights before its PDL wait and sums the token's experts and the shared expert in the same launch
(no combine launch). On a GPU the gate-up runs in one wave of programs, each streaming its tiles
with the next tile's reads in flight while it computes the current one: with a program a tile,
Ming-flash's rank took 4.4 waves, each program's reads waiting for one before it to leave its SM.

The down launch may read before its wait what no kernel writes (the weights, `pdl.STATIC_OPERANDS`)
and what the launch two back wrote (the router's ids and weights, `pdl.SETTLED_OPERANDS`): the
kernel before it, the gate-up, waits for the router to complete before it lets the down launch
start. So the down weights of the chosen experts stream while the gate-up runs. Each program holds
its rows of every chosen expert's down weight in registers (a whole row: K is the intermediate
size); products and sums in fp32 on CUDA cores (one row: no tensor-core tile to fill), the
roundings the reference makes (each expert's output in the activation dtype, times its routing
weight in fp32, the sum rounded, then the shared expert's output added and rounded again).

`selecting_experts` (gate_up_select.py's launches; issue 40): the streaming gate-up selects the
experts itself from the router's logits after its wait (each program, by the router's rule:
`route_select.choose_experts`) and its program 0 stores the ids and routing weights; the down
launch then reads those after its wait (`IDS_SETTLED=False`: one launch back), only the shared
expert's rows before it -- unless the ids-ready flag serves (`IDS_FLAGGED`, `ready_flag.py`; the
default, OMNISTAGE_THINKER_DOWN_FLAG): program 0 raises it after its stores, and each down program
that sees it before its wait reads the ids and its chosen experts' rows then, keeping after the wait
the rows of each slot whose id it reads again unchanged (the same bits whatever it saw).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import interpreting, pdl, ready_flag
from omnistage.services.thinker.kernels.norms import silu_mul
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels
from omnistage.services.thinker.kernels.ready_flag import lower_flag, poll_flag, raise_flag
from omnistage.services.thinker.kernels.route_select import (
    choose_experts,
    expert_grid,
    load_logits,
    routing_weights,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Weight bytes a program holds in registers. One H200, 2026-11-29 (bench/moe_one_token_gpu.py, router +
# experts graph-timed, µs a layer): Ling-mini 25.6 at gate-up 8 rows (64 KiB) / down 4 rows (36 KiB),
# 4 warps, against 29.0 at 4 / 2 and 31.7 for the aligned path; Ming-flash TP=2's rank 42-47 at 2-8 /
# 4 rows against 50.2 aligned.
_PROGRAM_BYTES = 64 * 1024
# The gate-up launch streams its tiles of STREAM_ROWS rows in STREAM_PROGRAMS_PER_SM programs an SM
# (one wave; `OneTokenTiles.programs`). One H200, 2026-11-29 (bench/moe_one_token_gpu.py, as above):
# Ming-flash TP=2's rank 41.8 µs a layer (41.3 at 2 programs an SM) against 46.3 with a program a tile
# of 4 rows; Ling-mini 25.1 either way (2 programs an SM 27.4; tiles of 4 rows 25.9-27.7, of 8 rows
# 34.6-38.6: two such tiles in flight spill).
STREAM_ROWS, STREAM_PROGRAMS_PER_SM = 2, 4


@dataclass(frozen=True)
class OneTokenTiles:
    """Rows a program of each launch (gate-up: intermediate columns, of both the gate and the up
    weight; down: hidden rows, of every chosen expert), and their warps; `programs` > 0: the gate-up
    launch in that many programs, each streaming its tiles of `gate_up_rows`
    (`_one_token_gate_up_stream_kernel`), else a program a tile."""

    gate_up_rows: int
    down_rows: int
    warps: int = 4
    programs: int = 0


def default_tiles(
    hidden: int, inter: int, top_k: int, element_size: int, warps: int = 4, sms: int = 0
) -> OneTokenTiles:
    """Down: the most rows (a power of two) whose weights fit `_PROGRAM_BYTES`, (top_k + 1) x rows x
    intermediate (the shared expert's rows besides). Gate-up: with `sms` (the device's SMs) streamed
    in STREAM_PROGRAMS_PER_SM programs an SM, else a program a tile of the most rows whose 2 x rows x
    hidden fit the budget."""
    budget = _PROGRAM_BYTES // element_size

    def rows(per_row: int) -> int:
        n = max(1, budget // per_row)
        return 1 << (n.bit_length() - 1)

    gate_up = STREAM_ROWS if sms > 0 else rows(2 * triton.next_power_of_2(hidden))
    down = rows((top_k + 1) * triton.next_power_of_2(inter))
    return OneTokenTiles(
        min(gate_up, triton.next_power_of_2(inter)),
        min(down, triton.next_power_of_2(hidden)),
        warps,
        STREAM_PROGRAMS_PER_SM * sms,
    )


@functools.cache
def sm_count(device: torch.device) -> int:
    """The SMs the streaming gate-up spreads over: the CUDA device's, one under the interpreter (so
    the CPU tests run the path the GPU takes, in STREAM_PROGRAMS_PER_SM programs)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


def supported(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, shared: tuple | None
) -> bool:
    """The one dispatch rule: one token, a power-of-two top-k, a shared expert of an expert's shape,
    one dtype, contiguous weights, on CUDA (or under TRITON_INTERPRET=1)."""
    return ids.shape[0] == 1 and supports(x, w13, w2, ids.shape[1], shared)


def supports(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int, shared: tuple | None) -> bool:
    """`supported`'s rule before the ids exist (gate_up_select.py asks it before the router runs)."""
    if shared is None or x.shape[0] != 1:
        return False
    gate_up, down = shared
    return (
        top_k & (top_k - 1) == 0
        and x.dtype in DTYPES
        and w13.dtype == w2.dtype == gate_up.dtype == down.dtype == x.dtype
        and gate_up.shape == w13.shape[1:]
        and down.shape == w2.shape[1:]
        and all(t.is_contiguous() for t in (w13, w2, gate_up, down))
        and (x.is_cuda or interpreting())
    )


@triton.jit
def _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N: tl.constexpr):
    """silu(gate)·up of tile t (`_tile_weights`' rows times x, fp32 sums) into h[slot] at its columns."""
    blocks = tl.cdiv(inter, BLOCK_N)
    gate = tl.sum(gate_w.to(tl.float32) * x[None, :], axis=1)
    up = tl.sum(up_w.to(tl.float32) * x[None, :], axis=1)
    cols = (t % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = silu_mul(gate, up, h_ptr.dtype.element_ty)
    tl.store(h_ptr + (t // blocks) * inter + cols, h, mask=cols < inter)


@triton.jit
def _tile_weights(
    w13_ptr,
    shared_ptr,
    ids_ptr,
    t,
    sizes,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    H_PAD: tl.constexpr,
    chosen,
    SELECT: tl.constexpr,
):
    """Tile t's gate and up rows [BLOCK_N, H_PAD] (tile t: slot t // blocks -- TOP_K the shared
    expert --, intermediate columns of block t % blocks); zeros past the last tile. `sizes` =
    (inter, hidden, the experts' stride). The slot's expert: SELECT, from `chosen` [TOP_K] (the
    launch's own selection, in registers), else read at ids_ptr (`chosen` unread)."""
    inter, hidden, stride_we = sizes
    blocks = tl.cdiv(inter, BLOCK_N)
    slot = t // blocks
    if slot < TOP_K:
        if SELECT:
            expert = tl.sum(tl.where(tl.arange(0, TOP_K) == slot, chosen, 0))
        else:
            expert = tl.load(ids_ptr + slot)
        base = w13_ptr + expert * stride_we
    else:
        base = shared_ptr
    cols = (t % blocks) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    mask = (cols < tl.where(slot <= TOP_K, inter, 0))[:, None] & (ks < hidden)[None, :]
    rows = cols.to(tl.int64)[:, None] * hidden + ks[None, :]
    return tl.load(base + rows, mask=mask, other=0.0), tl.load(
        base + inter * hidden + rows, mask=mask, other=0.0
    )


@triton.jit
def _one_token_gate_up_kernel(
    x_ptr,
    w13_ptr,
    shared_ptr,
    ids_ptr,
    h_ptr,
    inter,
    hidden,
    stride_we,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    H_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (column block, slot): tile slot · blocks + block (`_tile_weights`), silu(gate)·up of
    intermediate columns [n·BLOCK_N, +BLOCK_N) for the token's slot-th expert (slot TOP_K: the
    shared expert) into h[slot]."""
    wait_for_prior_kernels(USE_PDL)
    t = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    sizes = (inter, hidden, stride_we)
    gate_w, up_w = _tile_weights(
        w13_ptr, shared_ptr, ids_ptr, t, sizes, TOP_K, BLOCK_N, H_PAD, ids_ptr, False
    )
    ks = tl.arange(0, H_PAD)
    x = tl.load(x_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
    _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N)


@triton.jit
def _own_selection(
    logits_ptr,
    bias,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
):
    """The token's expert ids [1, TOP_K] from the router's fp32 logits (the launch before wrote
    them: read after the wait) and the fp32 expert bias: `route_select.choose_experts` over
    `load_logits`, the router's own selection (the same ops, the same bits)."""
    one = tl.arange(0, 1)
    logits = load_logits(logits_ptr + one, one == 0, NUM_EXPERTS, GROUPS)
    return choose_experts(logits, bias, NUM_EXPERTS, GROUPS, TOPK_GROUP, TOP_K)


@triton.jit
def _store_routing(
    logits_ptr, chosen, ids_ptr, weights_ptr, flag_ptr, scaling, TOP_K: tl.constexpr, FLAG: tl.constexpr
):
    """Program 0 of the selecting gate-up: the ids `chosen` [1, TOP_K] and their routing weights
    times `scaling` (`route_select.routing_weights`, as the router stores them) where the down
    launch reads them after its wait, and with FLAG then the ids-ready flag raised
    (`ready_flag.raise_flag`: the down may read them before its wait); the other programs store
    nothing."""
    if tl.program_id(0) == 0:
        one = tl.arange(0, 1)
        w = routing_weights(logits_ptr + one, chosen, one == 0)
        out = tl.arange(0, TOP_K)[None, :]
        tl.store(weights_ptr + out, w * scaling)
        tl.store(ids_ptr + out, chosen)
        if FLAG:
            raise_flag(flag_ptr)


@triton.jit
def _one_token_gate_up_stream_kernel(
    x_ptr,
    w13_ptr,
    shared_ptr,
    ids_ptr,
    h_ptr,
    logits_ptr,
    bias_ptr,
    weights_ptr,
    flag_ptr,
    inter,
    hidden,
    stride_we,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    H_PAD: tl.constexpr,
    SELECT: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    GROUPS: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    FLAG: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """The gate-up launch in one wave: program p of P computes tiles p, p + P, ... (`_tile_weights`;
    h[slot] as `_one_token_gate_up_kernel`), the next tile's weights loaded before the current
    tile's products, so each program keeps two tiles' reads in flight and no program waits for
    another to leave its SM. The experts: the router's ids at ids_ptr, or SELECT each program's own
    selection from the router's logits (`_own_selection`; the expert bias, a static operand, read
    before the wait; NUM_EXPERTS, GROUPS, TOPK_GROUP the router's shape), program 0 storing the ids
    and the routing weights (`_store_routing`) for the down launch, with FLAG then raising the flag
    at flag_ptr; else logits, bias, weights and flag unread."""
    if SELECT:
        bias = tl.load(bias_ptr + expert_grid(NUM_EXPERTS, GROUPS)).to(tl.float32)
    wait_for_prior_kernels(USE_PDL)
    if SELECT:
        picked = _own_selection(logits_ptr, bias, NUM_EXPERTS, GROUPS, TOPK_GROUP, TOP_K)
        chosen = tl.reshape(picked, (TOP_K,))
    else:
        chosen = ids_ptr  # unread: each tile reads its expert at ids_ptr
    sizes = (inter, hidden, stride_we)
    blocks = tl.cdiv(inter, BLOCK_N)
    ks = tl.arange(0, H_PAD)
    x = tl.load(x_ptr + ks, mask=ks < hidden, other=0.0).to(tl.float32)
    t = tl.program_id(0)
    gate_w, up_w = _tile_weights(
        w13_ptr, shared_ptr, ids_ptr, t, sizes, TOP_K, BLOCK_N, H_PAD, chosen, SELECT
    )
    if SELECT:  # after the first tile's reads are in flight
        _store_routing(logits_ptr, picked, ids_ptr, weights_ptr, flag_ptr, scaling, TOP_K, FLAG)
    for _ in range(tl.program_id(0), blocks * (TOP_K + 1), tl.num_programs(0)):
        after = t + tl.num_programs(0)
        gate_next, up_next = _tile_weights(
            w13_ptr, shared_ptr, ids_ptr, after, sizes, TOP_K, BLOCK_N, H_PAD, chosen, SELECT
        )
        _finish_tile(gate_w, up_w, x, t, h_ptr, inter, BLOCK_N)
        gate_w, up_w, t = gate_next, up_next, after


@triton.jit
def _one_token_down_kernel(
    h_ptr,
    w2_ptr,
    shared_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    flag_ptr,
    hidden,
    inter,
    stride_we,
    num_experts,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    I_PAD: tl.constexpr,
    IDS_SETTLED: tl.constexpr,
    IDS_FLAGGED: tl.constexpr,
    POLLS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program n: hidden rows [n·BLOCK_N, +BLOCK_N) of the token's output (`_down_sums`). The shared
    expert's weight rows are read before the wait; the ids and routing weights, and the chosen
    experts' weight rows, before it when IDS_SETTLED (the router's, two launches back), else after
    it (the selecting gate-up's, the launch before) -- but for IDS_FLAGGED: where the gate-up's
    flag is seen before the wait (`ready_flag.poll_flag`, within POLLS loads), the ids then and
    their rows (ids outside [0, num_experts) not), kept after the wait for each slot whose id is
    the same read again (`ready_flag`'s docstring says why no bit changes)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, I_PAD)
    slots = tl.arange(0, TOP_K)
    c_ok, k_ok = cols < hidden, ks < inter
    rows = cols.to(tl.int64)[:, None] * inter + ks[None, :]
    mask = c_ok[:, None] & k_ok[None, :]
    if IDS_SETTLED:  # the router's, two launches back
        experts = tl.load(ids_ptr + slots, cache_modifier=".cg")
        w = tl.load(w2_ptr + _slot_rows(experts, stride_we, rows), mask=mask[None, :, :], other=0.0)
    if IDS_FLAGGED:  # the gate-up's, where its program 0 said they are stored
        seen, last = poll_flag(flag_ptr, POLLS)
        seen_slots = slots < tl.where(seen, TOP_K, 0)
        early = tl.load(ids_ptr + slots, mask=seen_slots, other=-1, cache_modifier=".cg")
        early = tl.where((early >= 0) & (early < num_experts), early, -1)
        early_ok = mask[None, :, :] & (early >= 0)[:, None, None]
        w_early = tl.load(w2_ptr + _slot_rows(early, stride_we, rows), mask=early_ok, other=0.0)
    w_shared = tl.load(shared_ptr + rows, mask=mask, other=0.0)
    if IDS_SETTLED:
        route = tl.load(weights_ptr + slots, cache_modifier=".cg")
    wait_for_prior_kernels(USE_PDL)
    if IDS_FLAGGED:
        lower_flag(flag_ptr, last)
    if not IDS_SETTLED:  # the gate-up's, the launch before (h's reads issued before the rows wait on them)
        experts = tl.load(ids_ptr + slots, cache_modifier=".cg")
        route = tl.load(weights_ptr + slots, cache_modifier=".cg")
    h = tl.load(h_ptr + slots[:, None] * inter + ks[None, :], mask=k_ok[None, :], other=0.0).to(tl.float32)
    if not IDS_SETTLED:
        fresh, kept = mask[None, :, :], 0.0
        if IDS_FLAGGED:  # a slot's early rows kept where its id is the same (masked off: the early values)
            fresh, kept = fresh & (early != experts)[:, None, None], w_early
        w = tl.load(w2_ptr + _slot_rows(experts, stride_we, rows), mask=fresh, other=kept)
    h_shared = tl.load(h_ptr + TOP_K * inter + ks, mask=k_ok, other=0.0).to(tl.float32)
    _down_sums(w, h, route, w_shared, h_shared, out_ptr, cols, c_ok)


@triton.jit
def _slot_rows(experts, stride_we, rows):
    """The offsets [TOP_K, BLOCK_N, I_PAD] of each slot's expert's rows `rows` in the down weights."""
    return experts[:, None, None] * stride_we + rows[None, :, :]


@triton.jit
def _down_sums(w, h, route, w_shared, h_shared, out_ptr, cols, c_ok):
    """Σ_slot round(expert_slot's down(h[slot])) · weight_slot in fp32, rounded, + round(shared
    down(h[TOP_K])), rounded, into out at `cols`: the roundings of the reference (w [TOP_K,
    BLOCK_N, I_PAD] the chosen experts' rows, zero past the sizes; h [TOP_K, I_PAD] fp32)."""
    dt = out_ptr.dtype.element_ty
    expert_out = tl.sum(w.to(tl.float32) * h[:, None, :], axis=2)  # [TOP_K, BLOCK_N]
    mix = tl.sum(expert_out.to(dt).to(tl.float32) * route[:, None], axis=0).to(dt)
    shared_out = tl.sum(w_shared.to(tl.float32) * h_shared[None, :], axis=1).to(dt)
    y = (mix.to(tl.float32) + shared_out.to(tl.float32)).to(dt)
    tl.store(out_ptr + cols, y, mask=c_ok)


@dataclass(frozen=True)
class RouterLogits:
    """A token's router output before its selection (`router.normed_logits`): the fp32 logits
    [1, E], and what the router selects with (its expert bias, groups, groups kept, top-k and
    scaling), for `selecting_experts`."""

    logits: torch.Tensor
    bias: torch.Tensor
    n_group: int
    topk_group: int
    top_k: int
    scaling: float


def _selection_args(
    select: RouterLogits | None, w13: torch.Tensor, routing: torch.Tensor, flag: torch.Tensor | None
) -> tuple[tuple, dict]:
    """The streaming gate-up's logits, bias, routing weights, flag and scaling, and the selection's
    constexprs; without `select` unread (the bias a weight as given: a static operand's pointer), the
    flag without `flag` (`ready_flag.flag_for`'s word, raised by program 0 after its stores)."""
    flagged = dict(FLAG=flag is not None)
    flag = routing if flag is None else flag
    if select is None:
        unread = dict(SELECT=False, NUM_EXPERTS=1, GROUPS=1, TOPK_GROUP=1)
        return (routing, w13, routing, flag, 1.0), unread | flagged
    shape = dict(NUM_EXPERTS=select.logits.shape[-1], GROUPS=select.n_group, TOPK_GROUP=select.topk_group)
    return (select.logits, select.bias, routing, flag, select.scaling), dict(SELECT=True, **shape) | flagged


def _gate_up(
    x: torch.Tensor,
    w13: torch.Tensor,
    ids: torch.Tensor,
    routing: torch.Tensor,
    shared: torch.Tensor,
    h: torch.Tensor,
    tiles: OneTokenTiles,
    select: RouterLogits | None,
    flag: torch.Tensor | None = None,
) -> None:
    """The gate-up launch into h [top_k + 1, I]: a program a tile, or `tiles.programs` streaming;
    with `select` the streaming launch selects from the router's logits and stores the ids and
    the routing weights (a program a tile refuses it: each program would select), then raises
    `flag` where given."""
    hidden, inter, top_k = x.shape[1], w13.shape[1] // 2, ids.numel()
    shape = dict(TOP_K=top_k, BLOCK_N=tiles.gate_up_rows, H_PAD=triton.next_power_of_2(hidden))
    if tiles.programs > 0:
        (logits, bias, routing, flag, scaling), selection = _selection_args(select, w13, routing, flag)
        _one_token_gate_up_stream_kernel[(tiles.programs,)](
            *(x, w13, shared, ids, h, logits, bias, routing, flag),
            *(inter, hidden, w13.stride(0), scaling),
            **shape,
            **selection,
            num_warps=tiles.warps,
            num_stages=1,
            **pdl.launch(x.device),
        )
    elif select is not None:
        raise ValueError("the gate-up selects the experts only when it streams (tiles.programs > 0)")
    else:
        grid = (triton.cdiv(inter, tiles.gate_up_rows), top_k + 1)
        args = (x, w13, shared, ids, h, inter, hidden, w13.stride(0))
        _one_token_gate_up_kernel[grid](*args, **shape, num_warps=tiles.warps, **pdl.launch(x.device))


def _down(
    h: torch.Tensor,
    w2: torch.Tensor,
    shared: torch.Tensor,
    ids: torch.Tensor,
    routing: torch.Tensor,
    out: torch.Tensor,
    tiles: OneTokenTiles,
    settled: bool,
    flag: torch.Tensor | None = None,
) -> None:
    """The down launch into out [1, H] from h [top_k + 1, I]: the ids [k] and fp32 routing weights
    [k] read before its wait where `settled` (the router's), else after it -- but with `flag` (the
    selecting gate-up raises it) each program reads them and its rows before its wait where it sees
    the flag within `ready_flag.POLLS` loads, and zeroes the flag again (the last program)."""
    inter, hidden = h.shape[1], out.shape[1]
    _one_token_down_kernel[(triton.cdiv(hidden, tiles.down_rows),)](
        *(h, w2, shared, ids, routing, out, ids if flag is None else flag),
        *(hidden, inter, w2.stride(0), w2.shape[0]),
        TOP_K=ids.numel(),
        BLOCK_N=tiles.down_rows,
        I_PAD=triton.next_power_of_2(inter),
        IDS_SETTLED=settled,
        IDS_FLAGGED=flag is not None,
        POLLS=1 if flag is None else ready_flag.POLLS,
        num_warps=tiles.warps,
        **pdl.launch(h.device),
    )


def one_token_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    tiles: OneTokenTiles | None = None,
) -> torch.Tensor:
    """x [1, H], w13 [E, 2I, H], w2 [E, H, I], the router's fp32 weights and ids [1, k], the shared
    expert's (gate_up [2I, H], down [H, I]) → [1, H] in x's dtype, as `fused_moe.fused_experts`."""
    routing = weights.reshape(-1).float().contiguous()
    return _experts(x, w13, w2, shared, tiles, ids.reshape(-1).contiguous(), routing, None)


def selecting_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    select: RouterLogits,
    shared: tuple[torch.Tensor, torch.Tensor],
    tiles: OneTokenTiles | None = None,
    flag: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`one_token_experts` from the router's logits (issue 40): the streaming gate-up's programs
    each select the experts after their wait (`route_select.choose_experts`, the router's rule),
    program 0 stores the ids and the routing weights times the scaling, and the down launch reads
    them after its wait (one launch back now) -- with `flag` (OMNISTAGE_THINKER_DOWN_FLAG) program 0
    then raises the ids-ready flag and each down program that sees it before its wait reads the
    ids and its chosen rows then (`ready_flag`; the same bits). → (out [1, H], fp32 weights [1, k],
    ids [1, k]), the router's selection's bits (gate_up_select.py's rule says where it serves)."""
    ids = torch.empty(1, select.top_k, dtype=torch.int64, device=x.device)
    routing = torch.empty(1, select.top_k, dtype=torch.float32, device=x.device)
    ready = ready_flag.flag_for(x.device) if flag else None
    out = _experts(x, w13, w2, shared, tiles, ids.view(-1), routing.view(-1), select, ready)
    return out, routing, ids


def _experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    shared: tuple[torch.Tensor, torch.Tensor],
    tiles: OneTokenTiles | None,
    ids: torch.Tensor,
    routing: torch.Tensor,
    select: RouterLogits | None,
    flag: torch.Tensor | None = None,
) -> torch.Tensor:
    """The two launches over the ids [k] and fp32 routing weights [k]: the router's (the down reads
    them before its wait), or with `select` the gate-up's (stored there, read after the wait, or
    before it where the down sees `flag` raised)."""
    _, hidden = x.shape
    inter, top_k = w13.shape[1] // 2, ids.numel()
    tiles = tiles or default_tiles(hidden, inter, top_k, x.element_size(), sms=sm_count(x.device))
    x = x.contiguous()
    h = torch.empty(top_k + 1, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(1, hidden, dtype=x.dtype, device=x.device)
    _gate_up(x, w13, ids, routing, shared[0], h, tiles, select, flag)
    _down(h, w2, shared[1], ids, routing, out, tiles, select is None, flag)
    return out
