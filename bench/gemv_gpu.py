"""The Triton GEMV (`kernels/gemv.py`) against cuBLAS at a decode step's projection shapes, one GPU.

    source bench/device_env.sh && python3 bench/gemv_gpu.py --out $OUT/gemv.json

For Ling-mini (TP=1) and Ming-flash's thinker at TP=2 (one rank's slices): the attention (qkv, o),
dense-MLP and shared-expert projections and the LM head, at M = 1, 2, 4, 8, 16 tokens in bf16:
µs a call of F.linear (cuBLAS) and of the kernel with its table / default config (each timed with
CUDA events over replays of a CUDA graph of 20 calls, so no launch cost), achieved GB/s, the max
abs difference from F.linear, and what the dispatch rule picks. Then a config sweep per shape
(within --sweep-s) that prints the best config per (N, K) as a line to paste into gemv.CONFIGS.
Exit status 1 when a result differs from F.linear by more than bf16 rounding.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import LING_MINI, MING_FLASH
from omnistage.services.thinker.kernels import gemv as gemv_kernels
from omnistage.services.thinker.kernels.gemv import GemvConfig, chooses_kernel, config_for, gemv

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the graph timer
from graph_timing import graph_time_us  # noqa: E402

CALLS = 20  # calls per captured graph
TOKENS = (1, 2, 4, 8, 16)
SWEEP = dict(block_n=(16, 32, 64), block_k=(128, 256, 512), split=(1, 2, 4, 8), warps=(4, 8), stages=(3, 4))


def projection_shapes(dims: dict, tp: int) -> dict[str, tuple[int, int]]:
    """name → (N, K) of one rank's weights: column-parallel rows split, row-parallel columns split."""
    h, d = dims["hidden_size"], dims["head_dim"]
    heads, kv = dims["num_attention_heads"] // tp, max(1, dims["num_key_value_heads"] // tp)
    dense, shared = (
        dims["intermediate_size"] // tp,
        dims["moe_intermediate_size"] * dims["num_shared_experts"] // tp,
    )
    return {
        "qkv": ((heads + 2 * kv) * d, h),
        "o": (h, heads * d),
        "dense_gate_up": (2 * dense, h),
        "dense_down": (h, dense),
        "shared_gate_up": (2 * shared, h),
        "shared_down": (h, shared),
        "lm_head": (-(-dims["vocab_size"] // tp), h),
    }


MODELS = {
    "ling-mini tp1": projection_shapes(LING_MINI, 1),
    "ming-flash tp2": projection_shapes(MING_FLASH, 2),
}


def time_us(fn, replays: int = 10) -> float:
    """µs a call of fn(): CALLS calls captured in one graph, replayed, CUDA-event timed."""
    return graph_time_us([fn] * CALLS, replays)


def gbps(m: int, n: int, k: int, us: float) -> float:
    return (n * k + m * k + m * n) * 2 / (us * 1e-6) / 1e9


def measure(model: str, name: str, n: int, k: int, m: int, w: torch.Tensor) -> dict:
    x = torch.randn(m, k, device=w.device, dtype=w.dtype)
    want = F.linear(x, w)
    got = gemv(x, w)
    diff = (got.float() - want.float()).abs().max().item()
    ok = diff <= 0.02 * want.float().abs().max().item() + 1e-2  # bf16 rounding of either sum
    cublas, ours = time_us(lambda: F.linear(x, w)), time_us(lambda: gemv(x, w))
    row = dict(
        model=model,
        proj=name,
        n=n,
        k=k,
        m=m,
        config=asdict(config_for(n, k)),
        cublas_us=round(cublas, 2),
        triton_us=round(ours, 2),
        cublas_gbps=round(gbps(m, n, k, cublas)),
        triton_gbps=round(gbps(m, n, k, ours)),
        max_abs_diff=diff,
        ok=ok,
        faster="triton" if ours < cublas else "cublas",
        dispatch="triton" if chooses_kernel(x, w) else "torch",
    )
    print(
        f"{model:15s} {name:15s} N={n:6d} K={k:5d} M={m:2d}  cuBLAS {cublas:7.2f} us "
        f"({row['cublas_gbps']:5d} GB/s)  triton {ours:7.2f} us ({row['triton_gbps']:5d} GB/s)  "
        f"diff {diff:.3g}{'' if ok else ' TOO LARGE'}  dispatch {row['dispatch']}",
        flush=True,
    )
    return row


def fits(cfg: GemvConfig, n: int, k: int) -> bool:
    """A config worth timing at (N, K): two K tiles a split at least, wide rows only for many rows."""
    return (cfg.split == 1 or k // cfg.split >= 2 * cfg.block_k) and (
        cfg.block_n <= 32 or n // cfg.block_n >= 16
    )


def wins_up_to(rows: list[dict], n: int, k: int) -> int:
    """The largest M up to which the kernel (as configured in this run) beat cuBLAS at every M."""
    limit = 0
    for r in sorted((r for r in rows if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"]):
        if r["faster"] != "triton":
            break
        limit = r["m"]
    return limit


def run_sweeps(rows: list[dict], tokens: tuple[int, ...], budget_s: float) -> list[dict]:
    """Configs in a fixed random order (a sweep cut short still samples the space), each compiled
    once and timed at every shape and M in `tokens`, until `budget_s` runs out; the best per (N, K,
    M) printed, and per (N, K) at M=1 as a line to paste into gemv.CONFIGS."""
    configs = [GemvConfig(*values) for values in itertools.product(*SWEEP.values())]
    random.Random(0).shuffle(configs)
    weights = {
        s: torch.randn(*s, device="cuda", dtype=torch.bfloat16) * 0.02
        for s in {(r["n"], r["k"]) for r in rows}
    }
    xs = {m: {k: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _, k in weights} for m in tokens}
    best: dict[tuple[int, int, int], tuple[float, GemvConfig]] = {}
    deadline, tried = time.monotonic() + budget_s, 0
    for cfg in configs:
        if time.monotonic() > deadline:
            break
        tried += 1
        for (n, k), w in weights.items():
            if not fits(cfg, n, k):
                continue
            for m in tokens:
                x = xs[m][k]
                try:
                    us = time_us(lambda: gemv(x, w, cfg), replays=5)  # noqa: B023 (used at once)
                except Exception as exc:  # a config the compiler refuses (registers, shared memory)
                    print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                    break
                if (n, k, m) not in best or us < best[n, k, m][0]:
                    best[n, k, m] = (us, cfg)
    print(f"sweep: {tried} of {len(configs)} configs timed", flush=True)
    found = []
    for (n, k, m), (us, cfg) in sorted(best.items()):
        cublas = min(r["cublas_us"] for r in rows if (r["n"], r["k"], r["m"]) == (n, k, m))
        found.append(dict(n=n, k=k, m=m, us=round(us, 2), cublas_us=cublas, config=asdict(cfg)))
        print(f"best config ({n}, {k}) M={m}: {us:.2f} us (cuBLAS {cublas:.2f}): {cfg}", flush=True)
        if m == min(tokens):
            c, limit = cfg, wins_up_to(rows, n, k)
            fields = f"{c.block_n}, {c.block_k}, {c.split}, {c.warps}, {c.stages}, {limit}"
            print(f"PASTE     ({n}, {k}): GemvConfig({fields}),", flush=True)
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gemv.json")
    ap.add_argument("--sweep-s", type=float, default=45.0, help="time for the config sweep (0: none)")
    ap.add_argument("--sweep-tokens", default="1,8", help="M the sweep times each config at")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    print("device", torch.cuda.get_device_name(0), "tuned shapes", sorted(gemv_kernels.CONFIGS), flush=True)
    rows = []
    for model, shapes in MODELS.items():
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
            rows += [measure(model, name, n, k, m, w) for m in TOKENS]
            del w
    tokens = tuple(int(t) for t in args.sweep_tokens.split(",") if t)
    best = run_sweeps(rows, tokens, args.sweep_s) if args.sweep_s > 0 else []
    summary = dict(device=torch.cuda.get_device_name(0), calls_per_graph=CALLS, rows=rows, best=best)
    write_result(args.out, summary, gpu=True)  # CUDA only: the script needs a GPU
    bad = [r for r in rows if not r["ok"]]
    print(
        f"SUMMARY rows {len(rows)} triton faster in {sum(r['faster'] == 'triton' for r in rows)}; "
        f"{len(bad)} beyond bf16 rounding",
        flush=True,
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
