"""Compile the thinker's Triton kernels for sm_90 on a machine without a GPU (triton's own ptxas):
the interpreter runs code the real compiler may reject (a reassigned constexpr, say), so CI
compiles each kernel with the argument types and constants the fast path launches it with.

Run as a script in a process without TRITON_INTERPRET (the kernels must be real JIT functions):
prints `ok NAME` or `FAIL NAME: why` per kernel, exits 1 on any failure.
"""

from __future__ import annotations

import sys

import triton
from omnistage.services.thinker.kernels import (
    argmax,
    dense_gate_up,
    embed_gather,
    fused_moe,
    gemv,
    moe_align,
    moe_one_token,
    norms,
    paged_attention,
    paged_prefill,
    peer_allreduce,
    resident_gemv,
    rope_table,
    router,
)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


LAUNCH_OPTIONS = ("num_warps",)


def compile_sm90(fn, types: dict[str, str], constants: dict[str, object]) -> object:
    """`types`: argument name → triton type ("*bf16", "i32", "fp32"); `constants`: constexpr values,
    and launch options (LAUNCH_OPTIONS: num_warps, default 4) as the launch passes them.
    A kernel with a USE_PDL constexpr is compiled as Hopper launches it: with PDL (kernels/pdl.py)."""
    options = {k: constants[k] for k in LAUNCH_OPTIONS if k in constants}
    constants = {k: v for k, v in constants.items() if k not in LAUNCH_OPTIONS}
    if "USE_PDL" in fn.arg_names:
        constants = {"USE_PDL": True, **constants}
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constants]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constant for {missing}")
    return triton.compile(ASTSource(fn, signature, constants), target=SM90, options=options)


B, I32, F32 = "*bf16", "i32", "fp32"
MOE_ROWS = {"pairs_ptr": "*i32", "counts_ptr": "*i32", "ends_ptr": "*i32", "num_rows_ptr": "*i32"}
MOE_SIZES = {
    n: I32
    for n in (
        "n_out",
        "k_in",
        "pairs_per_row",
        "num_pairs",
        "stride_am",
        "stride_we",
        "stride_wn",
        "stride_om",
    )
}
MOE_TILES = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "LOG2_EXPERTS": 8, "PRECISION": "tf32"}
ROUTE = {
    "x_ptr": B,
    "w_ptr": B,
    "bias_ptr": B,
    "logits_ptr": "*fp32",
    "partial_ptr": "*fp32",
    "tickets_ptr": "*i32",
    "weights_ptr": "*fp32",
    "ids_ptr": "*i64",
    # the folded add + RMSNorm's (NORM): the residual, the norm weight, the normed row and the sum
    "r_ptr": B,
    "norm_w_ptr": B,
    "normed_ptr": B,
    "sum_ptr": B,
    "num_tokens": I32,
    "hidden": I32,
    "stride_x": I32,
    "stride_r": I32,
    "stride_w": I32,
    "scaling": F32,
    "eps": F32,
}
GEMV = {
    "x_ptr": B,
    "w_ptr": B,
    "out_ptr": B,
    **{n: I32 for n in ("m", "n", "k", "k_per_split", "stride_x", "stride_w")},
}
RESIDENT = {
    **{n: B for n in ("x_ptr", "r_ptr", "norm_w_ptr", "w_ptr", "out_ptr", "sum_ptr")},
    # the QK-norm + rope epilogue's (ROT > 0): the q and k norm weights, cos, sin and the tickets
    **{n: B for n in ("qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr")},
    "tickets_ptr": "*i32",
    **{n: I32 for n in ("m", "n", "k", "stride_x", "stride_r", "stride_w", "stride_o", "stride_s")},
    **{n: I32 for n in ("stride_c", "q_heads", "qk_heads")},
    "eps": F32,
    "qk_eps": F32,
}
NO_ROPE = {"HEAD_DIM": 0, "ROT": 0, "QK_NORM": False}
ROUTE_SHAPE = {"NUM_EXPERTS": 256, "GROUPS": 8, "TOPK_GROUP": 4, "TOP_K": 8}
# The CUDA-core GEMV's launch (a token or four) and the select-only one: no dots, no splits.
ROUTE_GEMV = {"DOT": False, "SPLIT": 1, "PRECISION": "tf32", "NORM": False, "SELECT": True}
# One token's streaming gate-up: the router's ids, or its own selection from the router's logits
# (Ling-mini's router: 256 experts, 8 groups, the top 4; an fp32 expert bias).
ONE_TOKEN_STREAM = {"x_ptr": B, "w13_ptr": B, "shared_ptr": B, "ids_ptr": "*i64", "h_ptr": B}
ONE_TOKEN_STREAM |= {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "scaling": F32}
ONE_TOKEN_STREAM |= {"flag_ptr": "*i32"} | {n: I32 for n in ("inter", "hidden", "stride_we")}
NOT_SELECTING = {"SELECT": False, "NUM_EXPERTS": 1, "GROUPS": 1, "TOPK_GROUP": 1, "FLAG": False}
SELECTING = {"SELECT": True, "NUM_EXPERTS": 256, "GROUPS": 8, "TOPK_GROUP": 4, "FLAG": False}
ONE_TOKEN_DOWN = {"h_ptr": B, "w2_ptr": B, "shared_ptr": B, "ids_ptr": "*i64", "weights_ptr": "*fp32"}
ONE_TOKEN_DOWN |= {"out_ptr": B, "flag_ptr": "*i32"}
ONE_TOKEN_DOWN |= {n: I32 for n in ("hidden", "inter", "stride_we", "num_experts")}
UNFLAGGED = {"IDS_FLAGGED": False, "POLLS": 1}
DECODE_TYPES = {
    "q_ptr": B,
    "k_cache_ptr": B,
    "v_cache_ptr": B,
    "tables_ptr": "*i64",
    "ctx_ptr": "*i64",
    "out_ptr": B,
    "scale": F32,
    "group": I32,
    **{
        n: I32
        for n in (
            "stride_qb",
            "stride_qh",
            "stride_ob",
            "stride_oh",
            "stride_tb",
            "stride_cb",
            "stride_cs",
            "stride_ch",
            "stride_kt",
            "stride_kh",
            "stride_vt",
            "stride_vh",
        )
    },
    "k_ptr": B,
    "v_ptr": B,
    "slots_ptr": "*i64",
    # unread without the folded QK-norm + rope (ROT 0): the launch passes its q for them
    "qw_ptr": B,
    "kw_ptr": B,
    "cos_ptr": B,
    "sin_ptr": B,
    "stride_ct": I32,
    "eps": F32,
}
# The decode launch's tiles at Ling-mini's shape (head dim 128, a GQA group of 4: 4 merge rows).
DECODE_TILES = {"HEAD_DIM": 128, "PAGE": 16, "GROUP_PAD": 16, "GROUP_ROWS": 4, "BLOCK_N": 64}
DECODE_TILES |= {"PRELOAD_TILES": 1, "PRECISION": "tf32", "WRITE_KV": True}
DECODE_SPLIT_TYPES = {**DECODE_TYPES, "part_ptr": "*fp32", "stats_ptr": "*fp32", "tickets_ptr": "*i32"}

# The dense gate-up's operands (the norm's: r, norm_w, sum and eps, unread without NORM).
DENSE = {n: B for n in ("x_ptr", "r_ptr", "norm_w_ptr", "w_ptr", "h_ptr", "sum_ptr")}
DENSE |= {"eps": F32} | {n: I32 for n in ("inter", "hidden", "stride_x", "stride_r", "stride_s")}
UNNORMED = {"BLOCK_N": 2, "NORM": False, "RESIDUAL": False}
NORMED = {"BLOCK_N": 2, "NORM": True, "RESIDUAL": True}

CASES = {
    "count": (
        moe_align._count_kernel,
        {"ids_ptr": "*i64", "counts_ptr": "*i32", "num_pairs": I32},
        {"SPAN": 512},
    ),
    "runs": (
        moe_align._runs_kernel,
        {"counts_ptr": "*i32", "ends_ptr": "*i32", "cursor_ptr": "*i32", "num_rows_ptr": "*i32"}
        | {"pairs_ptr": "*i32", "num_pairs": I32, "shared_rows": I32},
        {"NUM_EXPERTS": 256, "BLOCK_M": 16},
    ),
    "scatter": (
        moe_align._scatter_kernel,
        {"ids_ptr": "*i64", "pairs_ptr": "*i32", "cursor_ptr": "*i32"},
        {},
    ),
    "gate_up": (
        fused_moe._expert_gemm_kernel,
        {"a_ptr": B, "w_ptr": B, "shared_w_ptr": B, "out_ptr": B, "weight_ptr": B, **MOE_ROWS, **MOE_SIZES},
        {**MOE_TILES, "GATED": True},
    ),
    "down": (
        fused_moe._expert_gemm_kernel,
        {
            "a_ptr": B,
            "w_ptr": B,
            "shared_w_ptr": B,
            "out_ptr": "*fp32",
            "weight_ptr": "*fp32",
            **MOE_ROWS,
            **MOE_SIZES,
        },
        {**MOE_TILES, "GATED": False, "BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64},
    ),
    "write_kv": (
        paged_attention._write_kv_kernel,
        {
            "k_ptr": B,
            "v_ptr": B,
            "k_cache_ptr": B,
            "v_cache_ptr": B,
            "slots_ptr": "*i64",
            "stride_kt": I32,
            "stride_vt": I32,
            "width": I32,
        },
        {"BLOCK": 512},
    ),
    "decode": (
        paged_attention._decode_kernel,
        {
            **DECODE_TYPES,
            "part_ptr": B,  # unread with one split
            "stats_ptr": B,
            "tickets_ptr": B,
        },
        DECODE_TILES | {"SPLITS": 1, "MIN_CHUNK": 128, "ROT": 0, "NORM": False},
    ),
    # A small decode grid split over the context: fp32 partials, tickets, the merge.
    "decode_split": (
        paged_attention._decode_kernel,
        {**DECODE_TYPES, "part_ptr": "*fp32", "stats_ptr": "*fp32", "tickets_ptr": "*i32"},
        DECODE_TILES | {"SPLITS": 16, "MIN_CHUNK": 128, "ROT": 0, "NORM": False},
    ),
    # Splits not a power of two (3 sequences of 4 KV heads: 10), a GQA group of 6 (8 merge rows).
    "decode_split_gqa6": (
        paged_attention._decode_kernel,
        {**DECODE_TYPES, "part_ptr": "*fp32", "stats_ptr": "*fp32", "tickets_ptr": "*i32"},
        DECODE_TILES | {"GROUP_ROWS": 8, "SPLITS": 10, "MIN_CHUNK": 128, "ROT": 0, "NORM": False},
    ),
    # A decode step's launch with the QK-norm + partial rope folded in (Ling's rotary dim 64 of 128).
    "decode_qk_rope": (
        paged_attention._decode_kernel,
        {**DECODE_TYPES, "part_ptr": "*fp32", "stats_ptr": "*fp32", "tickets_ptr": "*i32"},
        DECODE_TILES | {"SPLITS": 16, "MIN_CHUNK": 128, "ROT": 64, "NORM": True},
    ),
    # Tiles read before the PDL wait (`paged_attention.DecodeTiles`): two at Ling-mini's c=1 launch
    # (16 splits, 4 warps), four with the QK-norm + rope folded at its c=8 one (4 splits, 8 warps).
    "decode_preload2": (
        paged_attention._decode_kernel,
        DECODE_SPLIT_TYPES,
        DECODE_TILES | {"PRELOAD_TILES": 2, "SPLITS": 16, "MIN_CHUNK": 128, "ROT": 0, "NORM": False},
    ),
    "decode_preload4": (
        paged_attention._decode_kernel,
        DECODE_SPLIT_TYPES,
        DECODE_TILES
        | {"PRELOAD_TILES": 4, "SPLITS": 4, "MIN_CHUNK": 128, "ROT": 64, "NORM": True}
        | {"num_warps": 8},
    ),
    "prefill": (
        paged_prefill._prefill_kernel,
        {
            "q_ptr": B,
            "k_cache_ptr": B,
            "v_cache_ptr": B,
            "tables_ptr": "*i64",
            "tiles_ptr": "*i32",
            "out_ptr": B,
            "scale_log2": F32,
            "group": I32,
            **{
                n: I32
                for n in (
                    "stride_qt",
                    "stride_qh",
                    "stride_ot",
                    "stride_oh",
                    "stride_tb",
                    "stride_cb",
                    "stride_cs",
                    "stride_ch",
                )
            },
        },
        {"HEAD_DIM": 128, "PAGE": 16, "GROUP_PAD": 8, "BLOCK_Q": 8, "BLOCK_KV": 64, "PRECISION": "tf32"},
    ),
    "rms_norm": (
        norms._rms_norm_kernel,
        {
            "x_ptr": B,
            "r_ptr": B,
            "w_ptr": B,
            "out_ptr": B,
            "sum_ptr": B,
            "n": I32,
            "eps": F32,
            "stride_x": I32,
            "stride_r": I32,
            "stride_o": I32,
            "stride_s": I32,
        },
        {"HAS_RESIDUAL": True, "BLOCK": 2048},
    ),
    "qk_norm_rope": (
        norms._qk_norm_rope_kernel,
        {
            "q_ptr": B,
            "k_ptr": B,
            "qw_ptr": B,
            "kw_ptr": B,
            "cos_ptr": B,
            "sin_ptr": B,
            "num_q_heads": I32,
            "eps": F32,
            **{n: I32 for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_ct")},
        },
        {"HEAD_DIM": 128, "ROT": 64, "NORM": True},
    ),
    "silu_mul": (
        norms._silu_mul_kernel,
        {"x_ptr": B, "out_ptr": B, "width": I32, "stride_x": I32, "stride_o": I32},
        {"BLOCK": 512},
    ),
    "align_one_program": (
        moe_align._align_one_program_kernel,
        {
            "ids_ptr": "*i64",
            "pairs_ptr": "*i32",
            "counts_ptr": "*i32",
            "ends_ptr": "*i32",
            "num_rows_ptr": "*i32",
            "num_pairs": I32,
            "shared_rows": I32,
        },
        {"NUM_EXPERTS": 256, "BLOCK_M": 16, "CHUNK": 64},
    ),
    "combine": (
        fused_moe._combine_kernel,
        {"partial_ptr": "*fp32", "shared_ptr": B, "out_ptr": B, "hidden": I32},
        {"TOP_K": 8, "HAS_SHARED": True, "BLOCK": 1024},
    ),
    "route": (
        router._route_kernel,
        ROUTE,
        {**ROUTE_SHAPE, **ROUTE_GEMV, "BLOCK_T": 16, "BLOCK_E": 4, "BLOCK_H": 128, "GEMV": True},
    ),
    # A decode batch past four tokens: tensor-core dots over hidden splits, the last program sums.
    "route_dot": (
        router._route_kernel,
        ROUTE,
        {**ROUTE_SHAPE, "BLOCK_T": 16, "BLOCK_E": 32, "BLOCK_H": 128, "GEMV": True, "DOT": True}
        | {"SPLIT": 4, "PRECISION": "tf32", "NORM": False, "SELECT": True},
    ),
    # One decode token: the whole hidden row in one chunk; an fp32 expert bias.
    "route_one_token": (
        router._route_kernel,
        {**ROUTE, "bias_ptr": "*fp32"},
        {**ROUTE_SHAPE, **ROUTE_GEMV, "BLOCK_T": 1, "BLOCK_E": 4, "BLOCK_H": 2048, "GEMV": True},
    ),
    # One decode token with the MoE layer's add + RMSNorm folded in (Ling-mini's row in one chunk;
    # Ming-flash's 4096 takes the loops' second chunk, compiled here too: hidden is an argument).
    "route_normed": (
        router._route_kernel,
        {**ROUTE, "bias_ptr": "*fp32"},
        {**ROUTE_SHAPE, **ROUTE_GEMV, "BLOCK_T": 1, "BLOCK_E": 4, "BLOCK_H": 2048, "GEMV": True}
        | {"NORM": True},
    ),
    # The same giving the logits only, the gate-up selecting (`router.normed_logits`).
    "route_normed_logits": (
        router._route_kernel,
        {**ROUTE, "bias_ptr": "*fp32"},
        {**ROUTE_SHAPE, **ROUTE_GEMV, "BLOCK_T": 1, "BLOCK_E": 4, "BLOCK_H": 2048, "GEMV": True}
        | {"NORM": True, "SELECT": False},
    ),
    # The projections' GEMV: the default config (split-K partials in fp32) and a wide bf16 tile.
    "gemv_split": (
        gemv._gemv_kernel,
        {**GEMV, "out_ptr": "*fp32"},
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "PRECISION": "tf32"},
    ),
    "gemv_wide": (
        gemv._gemv_kernel,
        GEMV,
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 512, "PRECISION": "tf32"},
    ),
    "gemv_sum_splits": (
        gemv._sum_splits_kernel,
        {"partial_ptr": "*fp32", "out_ptr": B, "count": I32},
        {"SPLIT": 4, "BLOCK": 1024},
    ),
    # The weights-first projection: Ling-mini's qkv with the add + norm folded, Ming-flash TP=2's o.
    "resident_gemv_normed": (
        resident_gemv._resident_gemv_kernel,
        RESIDENT,
        {"BLOCK_N": 8, "K_PAD": 2048, "NORM": True, "RESIDUAL": True, **NO_ROPE},
    ),
    "resident_gemv": (
        resident_gemv._resident_gemv_kernel,
        RESIDENT,
        {"BLOCK_N": 4, "K_PAD": 4096, "NORM": False, "RESIDUAL": False, **NO_ROPE},
    ),
    # Ling-mini's qkv with its q and k heads QK-normed and roped in the launch (16 programs a head of
    # 128, rotary dim 64), and a small model's (64 rows a program: two heads of 32, no QK norm).
    "resident_gemv_qk_rope": (
        resident_gemv._resident_gemv_kernel,
        RESIDENT,
        {"BLOCK_N": 8, "K_PAD": 2048, "NORM": True, "RESIDUAL": True}
        | {"HEAD_DIM": 128, "ROT": 64, "QK_NORM": True},
    ),
    "resident_gemv_qk_rope_heads": (
        resident_gemv._resident_gemv_kernel,
        RESIDENT,
        {"BLOCK_N": 64, "K_PAD": 256, "NORM": True, "RESIDUAL": False}
        | {"HEAD_DIM": 32, "ROT": 32, "QK_NORM": False},
    ),
    # One token's experts (Ling-mini's tiles): the gate-up reading the ids, the down reading early.
    "one_token_gate_up": (
        moe_one_token._one_token_gate_up_kernel,
        {"x_ptr": B, "w13_ptr": B, "shared_ptr": B, "ids_ptr": "*i64", "h_ptr": B}
        | {n: I32 for n in ("inter", "hidden", "stride_we")},
        {"TOP_K": 8, "BLOCK_N": 4, "H_PAD": 2048},
    ),
    # The same streaming its tiles (`OneTokenTiles.programs`: STREAM_ROWS rows a tile), reading the
    # router's ids (Ming-flash's row) or selecting from its logits (Ling-mini's: gate_up_select.py).
    "one_token_gate_up_stream": (
        moe_one_token._one_token_gate_up_stream_kernel,
        ONE_TOKEN_STREAM,
        {"TOP_K": 8, "BLOCK_N": 2, "H_PAD": 4096} | NOT_SELECTING,
    ),
    "one_token_gate_up_stream_select": (
        moe_one_token._one_token_gate_up_stream_kernel,
        ONE_TOKEN_STREAM,
        {"TOP_K": 8, "BLOCK_N": 2, "H_PAD": 2048} | SELECTING,
    ),
    # ... raising the ids-ready flag after program 0's stores (ready_flag.py; the default).
    "one_token_gate_up_stream_select_flag": (
        moe_one_token._one_token_gate_up_stream_kernel,
        ONE_TOKEN_STREAM,
        {"TOP_K": 8, "BLOCK_N": 2, "H_PAD": 2048} | SELECTING | {"FLAG": True},
    ),
    # The down: the router's ids before its wait, or the selecting gate-up's after it, or before it
    # too where the program sees the gate-up's flag (its poll, its rows; PTX_ORDER below).
    "one_token_down": (
        moe_one_token._one_token_down_kernel,
        ONE_TOKEN_DOWN,
        {"TOP_K": 8, "BLOCK_N": 2, "I_PAD": 512, "IDS_SETTLED": True} | UNFLAGGED,
    ),
    "one_token_down_after_wait": (
        moe_one_token._one_token_down_kernel,
        ONE_TOKEN_DOWN,
        {"TOP_K": 8, "BLOCK_N": 4, "I_PAD": 512, "IDS_SETTLED": False} | UNFLAGGED,
    ),
    "one_token_down_flagged": (
        moe_one_token._one_token_down_kernel,
        ONE_TOKEN_DOWN,
        {"TOP_K": 8, "BLOCK_N": 4, "I_PAD": 512, "IDS_SETTLED": False, "IDS_FLAGGED": True, "POLLS": 256},
    ),
    # The dense MLP's gate-up + SiLU·mul streamed (STREAM_ROWS rows a tile): one token at
    # Ling-mini's hidden size, two at Ming-flash's; and one token with the post-attention add +
    # RMSNorm folded in (NORM, RESIDUAL: `normed_gate_up_act`) at each.
    "dense_gate_up": (dense_gate_up._dense_gate_up_kernel, DENSE, {"TWO": False, "H_PAD": 2048} | UNNORMED),
    "dense_gate_up_two": (
        dense_gate_up._dense_gate_up_kernel,
        DENSE,
        {"TWO": True, "H_PAD": 4096} | UNNORMED,
    ),
    "dense_gate_up_normed": (
        dense_gate_up._dense_gate_up_kernel,
        DENSE,
        {"TWO": False, "H_PAD": 2048} | NORMED,
    ),
    "dense_gate_up_normed_4096": (
        dense_gate_up._dense_gate_up_kernel,
        DENSE,
        {"TWO": False, "H_PAD": 4096} | NORMED,
    ),
    # A prefill: the selection alone over cuBLAS's fp32 logits, a program a token (w: the gate
    # weight as given, unread: a static operand on every path).
    "router": (
        router._route_kernel,
        {**ROUTE, "x_ptr": "*fp32", "tickets_ptr": "*i64"},
        {**ROUTE_SHAPE, **ROUTE_GEMV, "BLOCK_T": 1, "BLOCK_E": 256, "BLOCK_H": 16, "GEMV": False},
    ),
    # The greedy sampling's argmax: fp32 logit rows, a program a chunk, the last of a row writes.
    "argmax": (
        argmax._argmax_kernel,
        {"x_ptr": "*fp32", "out_ptr": "*i64", "slots_ptr": "*i64", "tickets_ptr": "*i32"}
        | {"n": I32, "stride_x": I32},
        {"BLOCK": argmax.BLOCK},
    ),
    # The step's rope cos/sin from the table: bf16 rows, int64 positions and axes (rotary dim 64).
    "rope_gather": (
        rope_table._rope_gather_kernel,
        {"rows_ptr": B, "pos_ptr": "*i64", "axes_ptr": "*i64", "out_ptr": B}
        | {n: I32 for n in ("num_tokens", "stride_axis", "stride_t", "lo", "num_rows")},
        {"ROT": 64, "BLOCK_T": rope_table.BLOCK_T, "BLOCK_R": 64},
    ),
    # The step's token rows: int64 staged ids and sampled ids, a bf16 shard of hidden 2048.
    "embed_gather": (
        embed_gather._embed_gather_kernel,
        {"ids_ptr": "*i64", "feed_ptr": "*i64", "weight_ptr": B, "out_ptr": B}
        | {n: I32 for n in ("feed_len", "vocab_size", "start", "end", "hidden")},
        {"HAS_FEED": True, "BLOCK_H": embed_gather.BLOCK_H},
    ),
    "peer_allreduce": (
        peer_allreduce._one_shot_kernel,
        {"x_ptr": B, "table_ptr": "*i64", "n": I32, "rank": I32, "half_bytes": I32},
        {"WORLD": 3, "WORLD_P2": 4, "BLOCK": 1024, "USE_CLOCK": True},
    ),
}


def _in_order(ptx: str, *steps: str) -> bool:
    """Whether each of `steps` occurs in `ptx` after the one before it (the first after the start)."""
    at = 0
    for step in steps:
        at = ptx.find(step, at)
        if at < 0:
            return False
    return True


def _loads_before_wait(ptx: str) -> int:
    return ptx[: ptx.find("griddepcontrol.wait")].count("ld.global.b16")


# Cases whose compiled order matters (the interpreter cannot show it): the flagged down's poll (its
# volatile loads, its acquire ticket) and its early ids before its PDL wait; the selecting gate-up's
# stores of the ids, a CTA barrier, then its release.
PTX_ORDER = {
    "one_token_down_flagged": (
        "ld.volatile.global",
        "atom.global.gpu.acquire.add",
        "ld.global.cg.b64",
        "griddepcontrol.wait",
    ),
    "one_token_gate_up_stream_select_flag": (
        "griddepcontrol.wait",
        "st.global.b64",
        "bar.sync",
        "red.global.gpu.release.or",
    ),
}
# (case, case with the same tiles reading its rows after its wait, the slots' rows read before the
# wait over the other's): the flagged down loads each chosen expert's rows (TOP_K of them) before
# its wait beside the shared expert's (the other case's only loads before it).
ROWS_BEFORE_WAIT = [("one_token_down_flagged", "one_token_down_after_wait", 8)]


def main() -> int:
    failed, ptx = 0, {}
    for name, (fn, types, constants) in sorted(CASES.items()):
        try:
            compiled = compile_sm90(fn, types, constants)
            assert compiled.asm["cubin"], "no machine code"
            ptx[name] = compiled.asm["ptx"]
            assert _in_order(ptx[name], *PTX_ORDER.get(name, ())), f"not in order: {PTX_ORDER[name]}"
            print(f"ok {name}", flush=True)
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
    for name, other, slots in ROWS_BEFORE_WAIT:
        early, shared = _loads_before_wait(ptx.get(name, "")), _loads_before_wait(ptx.get(other, ""))
        if not shared or early < (slots + 1) * shared:
            failed += 1
            print(f"FAIL rows before the wait: {name} {early}, {other} {shared} (x{slots + 1})", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
