"""Build FlashInfer's paged-prefill kernels for the thinker's configuration before `serve` starts, and
check them against the Triton kernel (bf16, one mixed step: a chunk over a cached prefix, a whole
prompt, decode rows).

    python bench/flashinfer_prebuild.py [--families auto,fa2] [--heads 16,2] [--out DIR]

FlashInfer JIT-builds a kernel module the first time a configuration is planned (dtype, head_dim 128,
causal, no soft cap: one module per family) with the machine's nvcc, into ~/.cache/flashinfer, where
every later process (each thinker rank) finds it. Each family builds in its own process, in parallel;
each prints `family ok|FAIL ...` with its build seconds and its error against the fp32 reference. The
last line is the first family that works (`auto` is fa3 on Hopper), for OMNISTAGE_FLASHINFER_BACKEND;
"none" when none does (serve then falls back to Triton by itself). OUT/flashinfer_prebuild.json keeps it all.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from omnistage.common.bench_results import write_result

PAGE, HEAD_DIM = 16, 128


def one_family(heads: int, kv_heads: int) -> dict:
    """In this process (OMNISTAGE_FLASHINFER_BACKEND set by the parent): build, run, compare."""
    import torch
    from omnistage.services.thinker.kernels.flashinfer_attention import FlashInferPrefill
    from omnistage.services.thinker.kernels.paged_prefill import paged_prefill, prefill_tiles, tile_tokens
    from omnistage.services.thinker.models.layers.attention import AttentionMetadata

    torch.manual_seed(0)
    dev = torch.device("cuda", 0)
    query_lens, context_lens = [300, 64, 1, 1], [1300, 64, 700, 40]
    pages = [-(-c // PAGE) for c in context_lens]
    order = torch.randperm(sum(pages) + 8).tolist()
    tables = torch.full((len(pages), max(pages)), -1, dtype=torch.int64)
    for i, n in enumerate(pages):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    k_cache = torch.randn(sum(pages) + 8, PAGE, kv_heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(sum(query_lens), heads, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    md = AttentionMetadata(query_lens, context_lens, host_block_tables=tables)
    scale = HEAD_DIM**-0.5
    started = time.monotonic()
    fi = FlashInferPrefill()
    got = fi.run(q, k_cache, v_cache, md, scale)
    torch.cuda.synchronize()
    built_s = round(time.monotonic() - started, 1)
    if got is None:
        return {"ok": False, "why": fi.failed, "seconds": built_s}
    tiles = prefill_tiles(query_lens, context_lens, tile_tokens(heads, kv_heads)).to(dev)
    triton_out = paged_prefill(q, k_cache, v_cache, tables.to(dev), tiles, scale)
    ref = paged_prefill(q.float(), k_cache.float(), v_cache.float(), tables.to(dev), tiles, scale)
    rel = {
        n: float((o.float() - ref).norm() / ref.norm())
        for n, o in (("flashinfer", got), ("triton", triton_out))
    }
    return {"ok": rel["flashinfer"] < 2e-2, "seconds": built_s, "rel_err_vs_fp32": rel}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="auto,fa2")
    ap.add_argument("--heads", default="16,2", help="query heads, KV heads of one rank (Ming at TP=2)")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    heads, kv_heads = (int(x) for x in args.heads.split(","))
    if args.child:
        print(json.dumps(one_family(heads, kv_heads)), flush=True)
        return 0
    families = [f for f in args.families.split(",") if f]
    procs = {
        f: subprocess.Popen(
            [sys.executable, __file__, "--child", f, "--heads", args.heads],
            env=dict(os.environ, OMNISTAGE_FLASHINFER_BACKEND=f),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for f in families
    }
    results = {}
    for family, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        try:
            results[family] = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            results[family] = {"ok": False, "why": (stderr or stdout).strip()[-1500:]}
        print(
            f"{family} {'ok' if results[family]['ok'] else 'FAIL'} {json.dumps(results[family])}",
            file=sys.stderr,
        )
    if args.out:
        gpu = any(r["ok"] for r in results.values())  # a kernel built and ran: on a GPU
        write_result(Path(args.out, "flashinfer_prebuild.json"), results, gpu=gpu)
    print(next((f for f in families if results[f]["ok"]), "none"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
