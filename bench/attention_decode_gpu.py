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
from omnistage.services.thinker.kernels.paged_attention import decode_splits, paged_decode
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the graph timer
from graph_timing import graph_time_us as time_calls  # noqa: E402

CALLS = 8  # calls per captured graph, each on its own cache
DEVICE = "cuda"
PAGE, DIM = 16, 128
SHAPES = {"ling-mini tp1": (16, 4), "ming-flash tp2": (16, 2)}  # (query heads, KV heads) a rank
SEQS = (1, 2, 4, 8, 16, 32, 64)
CONTEXTS = (128, 512, 2048, 8192)


class Case:
    """CALLS layers' caches for `seqs` sequences of `ctx` tokens each, one query and new K/V a layer."""

    def __init__(self, heads: int, kv_heads: int, seqs: int, ctx: int) -> None:
        pages = -(-ctx // PAGE)
        self.caches = [
            torch.randn(2, seqs * pages, PAGE, kv_heads, DIM, device=DEVICE, dtype=torch.bfloat16).unbind(0)
            for _ in range(CALLS)
        ]
        self.tables = torch.arange(seqs * pages, device=DEVICE).view(seqs, pages)
        self.lens = torch.full((seqs,), ctx, device=DEVICE, dtype=torch.int32)
        last = self.tables[:, (ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE
        self.q = torch.randn(seqs, heads, DIM, device=DEVICE, dtype=torch.bfloat16)
        kv = torch.randn(2, seqs, kv_heads, DIM, device=DEVICE, dtype=torch.bfloat16)
        self.new_kv = (kv[0], kv[1], last)
        # --qk-rope: the raw q / k / v as views of the qkv rows, the QK-norm weights, the rope
        qkv = torch.randn(seqs, (heads + 2 * kv_heads) * DIM, device=DEVICE, dtype=torch.bfloat16)
        q, k, v = qkv.split([heads * DIM, kv_heads * DIM, kv_heads * DIM], dim=-1)
        self.raw = (q.view(seqs, heads, DIM), k.view(seqs, kv_heads, DIM), v.view(seqs, kv_heads, DIM))
        positions = torch.full((seqs,), ctx - 1, device=DEVICE)
        cos, sin = RotaryEmbedding(DIM, DIM // 2, 1e6, "default").cos_sin(positions, torch.bfloat16)
        weights = torch.randn(2, DIM, device=DEVICE, dtype=torch.bfloat16)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="attention_decode.json")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of: " + ", ".join(SHAPES))
    ap.add_argument("--seqs", default=",".join(map(str, SEQS)))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument(
        "--qk-rope",
        action="store_true",
        help="time QK-norm + rope folded into the decode launch against its own launch before it",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for name in args.shapes.split(","):
        heads, kv_heads = SHAPES[name]
        for seqs in (int(s) for s in args.seqs.split(",")):
            for ctx in (int(c) for c in args.contexts.split(",")):
                rows.append((bench_qk_case if args.qk_rope else bench_case)(name, heads, kv_heads, seqs, ctx))
                torch.cuda.empty_cache()
    mode = "qk_rope" if args.qk_rope else "splits"
    write_result(
        args.out,
        dict(device=torch.cuda.get_device_name(0), mode=mode, calls_per_graph=CALLS, rows=rows),
        gpu=True,
    )
    if args.qk_rope:
        print("SUMMARY qk-rope µs saved a call:", [(r["seqs"], r["context"], r["saved_us"]) for r in rows])
        unequal = [(r["seqs"], r["context"]) for r in rows if not r["bit_equal"]]
        worst = max((r["max_abs_diff"] for r in rows), default=0.0)
        print(f"SUMMARY qk-rope not bit-equal: {unequal}; worst difference {worst:.4f}", flush=True)
        return 1 if worst > 0.05 else 0
    split_rows = [r for r in rows if r["decode_splits"] > 1]
    for r in split_rows:
        r["speedup"] = round(r["whole_us"] / r[f"split{r['decode_splits']}_us"], 2)
    print(
        "SUMMARY split speed-up (chosen splits):",
        [(r["seqs"], r["context"], r["speedup"]) for r in split_rows],
    )
    worst = max((r["max_abs_diff"] for r in rows), default=0.0)
    print(f"SUMMARY worst split difference {worst:.4f}", flush=True)
    return 1 if worst > 0.05 else 0


if __name__ == "__main__":
    sys.exit(main())
