"""The paged decode attention (`kernels/paged_attention.py`) on one GPU at a decode step's shapes: the
whole-context launch (a program a (sequence, KV head)) against the context-split one (flash-decoding
in one launch), per (sequences, context).

    source bench/device_env.sh && python3 bench/attention_decode_gpu.py --out $OUT/attention_decode.json

For Ling-mini's attention (16 query heads, 4 KV heads, head dim 128) and Ming-flash's at TP=2 (16 and
2 per rank), bf16, pages of 16 tokens, at 1 … 64 sequences and contexts of 128 … 8192 tokens, with
the new K/V row written by the launch (as the decode step does): µs a call of `paged_decode` with
one split and with `decode_splits`' (and 2x / half that), each timed with CUDA events over replays
of a CUDA graph of CALLS calls, each call on its own layer's cache (so the cache comes from HBM),
with the largest difference of the split outputs from the whole-context one. Prints a row per case
and a SUMMARY of the split launch's speed-up; exit status 1 when a split output differs by more
than bf16 rounding.

    python3 bench/attention_decode_gpu.py --qk-rope --out $OUT/attention_decode_qk_rope.json

`--qk-rope` times instead a decode step's layer from the raw q / k (views of the qkv rows, QK-norm
weights, rope of rotary dim D/2 as Ling's): the separate launches (`qk_norm_rope` in place, then
`paged_decode`, as with OMNISTAGE_THINKER_FUSIONS=off) against the folded one (`paged_decode(...,
qk_rope=...)`, the fusions on), both at `decode_splits`' splits, graph-timed as above, with whether
their outputs are equal bit for bit (they should be: one rule, `norms.norm_rope_heads`); a SUMMARY
of the µs saved a call; exit status 1 when the outputs differ by more than bf16 rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.services.thinker.kernels.norms import qk_norm_rope
from omnistage.services.thinker.kernels.paged_attention import (
    DECODE_TILES,
    DecodeTiles,
    decode_splits,
    folds_qk_rope,
    paged_decode,
)
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the graph timer
from graph_timing import graph_time_us as time_calls  # noqa: E402

CALLS = 8  # calls per captured graph, each on its own cache
DEVICE = "cuda"
PAGE, DIM = 16, 128
SHAPES = {"ling-mini tp1": (16, 4), "ming-flash tp2": (16, 2)}  # (query heads, KV heads) a rank
SEQS = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 512, 2048, 8192)
# --preload's sweep: the decode step's batches at c=1 and c=8, a split's context up to a few tiles
PRELOAD_SEQS = (1, 8)
PRELOAD_CONTEXTS = (64, 128, 192, 256, 512)
PRELOAD_TILES = (1, 2, 4)
PRELOAD_WARPS = (4, 8)
BF16_ROUNDING = 0.05  # the largest difference of two bf16 outputs of one attention taken as rounding


class Case:
    """CALLS layers' caches for `seqs` sequences of `ctx` tokens each, one query and new K/V a layer."""

    def __init__(self, heads: int, kv_heads: int, seqs: int, ctx: int, device: str = DEVICE) -> None:
        pages = -(-ctx // PAGE)
        self.caches = [
            torch.randn(2, seqs * pages, PAGE, kv_heads, DIM, device=device, dtype=torch.bfloat16).unbind(0)
            for _ in range(CALLS)
        ]
        self.tables = torch.arange(seqs * pages, device=device).view(seqs, pages)
        self.lens = torch.full((seqs,), ctx, device=device, dtype=torch.int32)
        last = self.tables[:, (ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE
        self.q = torch.randn(seqs, heads, DIM, device=device, dtype=torch.bfloat16)
        kv = torch.randn(2, seqs, kv_heads, DIM, device=device, dtype=torch.bfloat16)
        self.new_kv = (kv[0], kv[1], last)
        # --qk-rope: the raw q / k / v as views of the qkv rows, the QK-norm weights, the rope
        qkv = torch.randn(seqs, (heads + 2 * kv_heads) * DIM, device=device, dtype=torch.bfloat16)
        q, k, v = qkv.split([heads * DIM, kv_heads * DIM, kv_heads * DIM], dim=-1)
        self.raw = (q.view(seqs, heads, DIM), k.view(seqs, kv_heads, DIM), v.view(seqs, kv_heads, DIM))
        positions = torch.full((seqs,), ctx - 1, device=device)
        cos, sin = RotaryEmbedding(DIM, DIM // 2, 1e6, "default").cos_sin(positions, torch.bfloat16)
        weights = torch.randn(2, DIM, device=device, dtype=torch.bfloat16)
        self.qk_rope = (weights[0], weights[1], 1e-6, cos, sin)

    def run(self, i: int, splits: int) -> torch.Tensor:
        k_cache, v_cache = self.caches[i]
        return paged_decode(self.q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5, self.new_kv, splits)

    def time_us(self, splits: int) -> float:
        return time_calls([lambda i=i: self.run(i, splits) for i in range(CALLS)])

    def run_qk(self, i: int, splits: int, fused: bool, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Layer i's attention from raw q / k: QK-norm + rope folded into the decode launch, or in a
        launch of its own before it (in place on q and k: a replay ropes them again, as cheap)."""
        (k_cache, v_cache), new_kv = self.caches[i], (k, self.raw[2], self.new_kv[2])
        if fused:
            return paged_decode(
                q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5, new_kv, splits, self.qk_rope
            )
        qk_norm_rope(q, k, *self.qk_rope)
        return paged_decode(q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5, new_kv, splits)

    def time_qk_us(self, splits: int, fused: bool) -> float:
        q, k, _ = self.raw
        return time_calls([lambda i=i: self.run_qk(i, splits, fused, q, k) for i in range(CALLS)])

    def run_step(self, i: int, splits: int, qk: bool, tiles: DecodeTiles, caches=None) -> torch.Tensor:
        """Layer i's decode launch as a decode step makes it (the new K/V written; QK-norm + rope
        folded where `qk`) at `tiles`, on `caches` (copies, for the bits) where given."""
        (k_cache, v_cache), (q, k, v) = caches or self.caches[i], self.raw
        new_kv, qk_rope = (k, v, self.new_kv[2]), self.qk_rope if qk else None
        return paged_decode(
            q, k_cache, v_cache, self.tables, self.lens, DIM**-0.5, new_kv, splits, qk_rope, tiles
        )


def bench_case(name: str, heads: int, kv_heads: int, seqs: int, ctx: int) -> dict:
    case = Case(heads, kv_heads, seqs, ctx)
    chosen = decode_splits(seqs, kv_heads)
    row = dict(model=name, seqs=seqs, context=ctx, decode_splits=chosen, whole_us=round(case.time_us(1), 2))
    whole = case.run(0, 1).float()
    worst = 0.0
    for splits in sorted({max(2, chosen // 2), chosen, min(64, 2 * chosen)} - {1}):
        row[f"split{splits}_us"] = round(case.time_us(splits), 2)
        worst = max(worst, float((case.run(0, splits).float() - whole).abs().max()))
    row["max_abs_diff"] = worst
    print(f"attn   {name:15s} seqs={seqs:3d} ctx={ctx:5d}  {row}", flush=True)
    return row


def bench_qk_case(name: str, heads: int, kv_heads: int, seqs: int, ctx: int) -> dict:
    case = Case(heads, kv_heads, seqs, ctx)
    splits = decode_splits(seqs, kv_heads)
    q, k, _ = case.raw
    # Compared first, on the raw q / k (the separate launch ropes its copies; the timing, q and k).
    separate = case.run_qk(0, splits, False, q.clone(), k.clone()).float()
    fused = case.run_qk(0, splits, True, q, k).float()
    row = dict(model=name, seqs=seqs, context=ctx, decode_splits=splits)
    row["separate_us"] = round(case.time_qk_us(splits, False), 2)
    row["fused_us"] = round(case.time_qk_us(splits, True), 2)
    row["saved_us"] = round(row["separate_us"] - row["fused_us"], 2)
    row["bit_equal"] = bool(torch.equal(fused, separate))
    row["max_abs_diff"] = float((fused - separate).abs().max())
    print(f"qkrope {name:15s} seqs={seqs:3d} ctx={ctx:5d}  {row}", flush=True)
    return row


def preload_variants(
    tiles: list[int], warps: list[int], chunks: list[int] | None = None
) -> list[DecodeTiles]:
    """The default (DECODE_TILES) first, then every (tiles, warps, a split's fewest tokens) triple,
    one tile at each (warps, fewest tokens) among them (the bits a preload is held to)."""
    chunks = chunks or [DECODE_TILES.min_chunk]
    triples = [DecodeTiles(t, w, c) for c in chunks for w in warps for t in sorted({1, *tiles})]
    return list(dict.fromkeys([DECODE_TILES, *triples]))


def variant_name(tiles: DecodeTiles) -> str:
    """p<tiles before the wait>w<warps>, and m<a split's fewest tokens> where not the default's."""
    chunk = "" if tiles.min_chunk == DECODE_TILES.min_chunk else f"m{tiles.min_chunk}"
    return f"p{tiles.preload_tiles}w{tiles.warps}{chunk}"


def _bit_equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True))


def preload_bits(outputs: dict[DecodeTiles, tuple[torch.Tensor, ...]]) -> dict[str, dict]:
    """Each variant's (output, K cache, V cache) against the default's (its first entry): bit-equal,
    the output's largest difference; and against one preloaded tile at its warps (`same_warps`:
    preloading must change no bit)."""
    default = next(iter(outputs.values()))
    found = {}
    for tiles, got in outputs.items():
        one_tile = outputs[DecodeTiles(1, tiles.warps, tiles.min_chunk)]
        found[variant_name(tiles)] = dict(
            equal_default=_bit_equal(got, default),
            equal_same_warps=_bit_equal(got, one_tile),
            max_abs_diff=float((got[0].float() - default[0].float()).abs().max()),
        )
    return found


def preload_failures(rows: list[dict]) -> list[str]:
    """The variants of `rows` that fail: preloading changed bits, or a difference past bf16 rounding."""
    return [
        f"seqs={r['seqs']} ctx={r['context']} {name}"
        for r in rows
        for name, bits in r["bits"].items()
        if not bits["equal_same_warps"] or bits["max_abs_diff"] > BF16_ROUNDING
    ]


def bench_preload_case(
    name: str,
    shape: tuple[int, int],
    seqs: int,
    ctx: int,
    variants: list[DecodeTiles],
    timer=None,
    device=DEVICE,
) -> dict:
    """One (sequences, context) case of --preload: µs a call of each variant (`timer`, the graph
    timer by default) and its bits (`preload_bits`)."""
    (heads, kv_heads), timer = shape, timer or time_calls
    case = Case(heads, kv_heads, seqs, ctx, device)
    splits, qk = decode_splits(seqs, kv_heads), folds_qk_rope(seqs, kv_heads, on_gpu=True)
    row = dict(model=name, seqs=seqs, context=ctx, decode_splits=splits, qk_rope_folded=qk)
    outputs = {}
    for tiles in variants:
        caches = tuple(c.clone() for c in case.caches[0])
        outputs[tiles] = (case.run_step(0, splits, qk, tiles, caches), *caches)
        calls = [lambda i=i, t=tiles: case.run_step(i, splits, qk, t) for i in range(CALLS)]
        row[f"{variant_name(tiles)}_us"] = round(timer(calls), 2)
    row["bits"] = preload_bits(outputs)
    timed = {variant_name(t): row[f"{variant_name(t)}_us"] for t in variants}
    row["fastest"] = min(timed, key=timed.get)
    print(f"preload {name:15s} seqs={seqs:3d} ctx={ctx:5d}  {timed} fastest {row['fastest']}", flush=True)
    return row


def preload_summary(rows: list[dict]) -> int:
    """Print --preload's SUMMARY; its exit status (1: `preload_failures`)."""
    best = [(r["seqs"], r["context"], r["fastest"], r[f"{r['fastest']}_us"]) for r in rows]
    print("SUMMARY preload fastest (seqs, context, variant, µs):", best)
    default = variant_name(DECODE_TILES)
    print("SUMMARY preload default µs:", [(r["seqs"], r["context"], r[f"{default}_us"]) for r in rows])
    unequal = [
        (r["seqs"], r["context"], n) for r in rows for n, b in r["bits"].items() if not b["equal_default"]
    ]
    failed = preload_failures(rows)
    print(f"SUMMARY preload not bit-equal to the default: {unequal}; failing: {failed}", flush=True)
    return 1 if failed else 0


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="attention_decode.json")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of: " + ", ".join(SHAPES))
    ap.add_argument("--seqs", help=f"default {SEQS}, with --preload {PRELOAD_SEQS}")
    ap.add_argument("--contexts", help=f"default {CONTEXTS}, with --preload {PRELOAD_CONTEXTS}")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument(
        "--qk-rope",
        action="store_true",
        help="time QK-norm + rope folded into the decode launch against its own launch before it",
    )
    mode.add_argument(
        "--preload", action="store_true", help="time the decode launch at each DecodeTiles (tiles x warps)"
    )
    ap.add_argument("--preload-tiles", default=",".join(map(str, PRELOAD_TILES)))
    ap.add_argument("--preload-warps", default=",".join(map(str, PRELOAD_WARPS)))
    ap.add_argument(
        "--min-chunks",
        default=str(DECODE_TILES.min_chunk),
        help="a split's fewest tokens to sweep too (e.g. 128,256: a context up to it in one split, no merge)",
    )
    args = ap.parse_args(argv)
    args.seqs = _ints(args.seqs or ",".join(map(str, PRELOAD_SEQS if args.preload else SEQS)))
    args.contexts = _ints(args.contexts or ",".join(map(str, PRELOAD_CONTEXTS if args.preload else CONTEXTS)))
    args.variants = preload_variants(
        _ints(args.preload_tiles), _ints(args.preload_warps), _ints(args.min_chunks)
    )
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        heads, kv_heads = SHAPES[name]
        for seqs in args.seqs:
            for ctx in args.contexts:
                if args.preload:
                    rows.append(bench_preload_case(name, (heads, kv_heads), seqs, ctx, args.variants))
                else:
                    rows.append(
                        (bench_qk_case if args.qk_rope else bench_case)(name, heads, kv_heads, seqs, ctx)
                    )
                torch.cuda.empty_cache()
    mode = "qk_rope" if args.qk_rope else "preload" if args.preload else "splits"
    write_result(
        args.out,
        dict(device=torch.cuda.get_device_name(0), mode=mode, calls_per_graph=CALLS, rows=rows),
        gpu=True,
    )
    if args.preload:
        return preload_summary(rows)
    if args.qk_rope:
        print("SUMMARY qk-rope µs saved a call:", [(r["seqs"], r["context"], r["saved_us"]) for r in rows])
        unequal = [(r["seqs"], r["context"]) for r in rows if not r["bit_equal"]]
        worst = max((r["max_abs_diff"] for r in rows), default=0.0)
        print(f"SUMMARY qk-rope not bit-equal: {unequal}; worst difference {worst:.4f}", flush=True)
        return 1 if worst > BF16_ROUNDING else 0
    split_rows = [r for r in rows if r["decode_splits"] > 1]
    for r in split_rows:
        r["speedup"] = round(r["whole_us"] / r[f"split{r['decode_splits']}_us"], 2)
    print(
        "SUMMARY split speed-up (chosen splits):",
        [(r["seqs"], r["context"], r["speedup"]) for r in split_rows],
    )
    worst = max((r["max_abs_diff"] for r in rows), default=0.0)
    print(f"SUMMARY worst split difference {worst:.4f}", flush=True)
    return 1 if worst > BF16_ROUNDING else 0


if __name__ == "__main__":
    sys.exit(main())
