"""The decode step's projections with their weights read before the PDL wait (`kernels/resident_gemv.py`)
against cuBLAS and the tiled Triton GEMV, in the chains a one-sequence decode step runs them in.

    source bench/device_env.sh && python3 bench/resident_gemv_gpu.py --out $OUT/resident_gemv.json

Each chain is captured `--reps` times in one CUDA graph, every repetition with its own weights (so
no repetition finds them in L2), and timed over replays: µs a repetition, the kernel before the
projection included (that is what the weights-first read overlaps). Chains, at Ling-mini TP=1's and
Ming-flash TP=2's shapes, one token:
- norm→qkv: add + RMSNorm, then the qkv projection (cuBLAS | tiled GEMV | resident | resident with
  the add + norm folded in: one launch);
- qkv→qk-rope: the resident qkv with the add + norm folded in, then QK-norm + rope of its q and k
  heads in a launch of its own (`norms.qk_norm_rope`, what a one-sequence decode step ran) | in the
  projection's launch (`resident_gemv.normed_qkv_rope`'s epilogue: one launch); and the
  `qk_norm_rope` launch alone;
- attn→o: the paged decode attention over a 256-token context, then the o projection;
- alone: the projection alone, back to back (its bandwidth with nothing to overlap).
Then a (rows, warps) sweep of the resident kernel per shape. And the dense layer's gate-up + SiLU·mul
(`kernels/dense_gate_up.py`, `--tokens` rows) against cuBLAS then the SiLU·mul launch:
- norm->: the post-attention add + RMSNorm, then either;
- the one launch with that add + norm folded in (`normed_gate_up_act`'s launch; the engine folds
  one token, `NORM_MAX_TOKENS`: `--tokens 2` times the two-token fold it leaves out);
- alone: either alone;
then a (rows, programs an SM, warps) sweep of the one launch (`--dense-only`: this part alone). Exit
status 1 when a result differs from F.linear (the dense part: from cuBLAS then the SiLU·mul) by more
than bf16 rounding, the qk-rope epilogue's from the separate launches' by a bit, or the folded
norm's from rms_norm then the launch (its sum by a bit; at one token its output by a bit).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import LING_MINI, MING_FLASH
from omnistage.services.thinker.kernels import gemv as tiled
from omnistage.services.thinker.kernels import pdl
from omnistage.services.thinker.kernels.dense_gate_up import DenseTiles, default_tiles, silu_gate_up
from omnistage.services.thinker.kernels.norms import qk_norm_rope, rms_norm, silu_and_mul
from omnistage.services.thinker.kernels.paged_attention import paged_decode
from omnistage.services.thinker.kernels.resident_gemv import ResidentConfig, fits, resident_gemv
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the graph timer
from graph_timing import graph_time_us  # noqa: E402

SWEEP = ((4, 4), (8, 4), (8, 8), (16, 8), (16, 16), (32, 16))
# The dense gate-up's (rows a tile, programs an SM, warps).
DENSE_SWEEP = ((1, 4, 4), (2, 1, 4), (2, 2, 4), (2, 4, 4), (2, 2, 8), (2, 4, 8), (4, 1, 8), (4, 2, 8))


def time_chain(step, reps: int, replays: int = 20) -> float:
    """µs a repetition of `step(i)` (i the repetition), captured `reps` times in one graph."""
    return graph_time_us([functools.partial(step, i) for i in range(reps)], replays)


def shapes(dims: dict, tp: int) -> dict[str, tuple[int, int]]:
    h, d = dims["hidden_size"], dims["head_dim"]
    heads, kv = dims["num_attention_heads"] // tp, max(1, dims["num_key_value_heads"] // tp)
    dense = dims["intermediate_size"] // tp
    return {"qkv": ((heads + 2 * kv) * d, h), "o": (h, heads * d), "dense_down": (h, dense)}


def projector(name: str, cfg: ResidentConfig | None = None):
    if name == "cublas":
        return F.linear
    if name == "tiled":
        return lambda x, w: tiled.gemv(x, w)
    return lambda x, w: resident_gemv(x, w, config=cfg)


def run_model(
    label: str, dims: dict, tp: int, reps: int, dev: torch.device, force: bool, tokens: int = 1
) -> dict:
    result: dict = {"shapes": {}, "chains": {}, "sweep": {}, "max_abs_diff": {}, "ok": True}
    for proj, (n, k) in shapes(dims, tp).items():
        result["shapes"][proj] = [n, k]
        if not fits(n, k, 2) and not force:
            print(f"[{label}] {proj} {n}x{k}: does not fit the resident budget", flush=True)
            result["chains"][proj] = "does not fit"
            continue
        measure_projection(label, proj, n, k, dims, tp, reps, dev, result, tokens)
    return result


def measure_projection(
    label: str,
    proj: str,
    n: int,
    k: int,
    dims: dict,
    tp: int,
    reps: int,
    dev: torch.device,
    result: dict,
    tokens: int = 1,
) -> None:
    """One projection's check against F.linear, its chains and its sweep, into `result`."""
    dt = torch.bfloat16
    h = dims["hidden_size"]
    heads, kv, d = (
        dims["num_attention_heads"] // tp,
        max(1, dims["num_key_value_heads"] // tp),
        dims["head_dim"],
    )
    x = torch.randn(tokens, h, dtype=dt, device=dev)
    res = torch.randn(tokens, h, dtype=dt, device=dev)
    norm_w = torch.randn(h, dtype=dt, device=dev)
    ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    xin = torch.randn(tokens, k, dtype=dt, device=dev)
    ref = F.linear(xin, ws[0]).float()
    diff = (resident_gemv(xin, ws[0]).float() - ref).abs().max().item()
    result["max_abs_diff"][proj] = diff
    if diff > 0.02 * ref.abs().max().item() + 1e-2:
        print(f"[{label}] {proj}: resident differs from F.linear by {diff}", flush=True)
        result["ok"] = False
    chains = {}
    for name in ("cublas", "tiled", "resident"):
        fn = projector(name)
        chains[f"alone {name}"] = time_chain(lambda i, fn=fn: fn(xin, ws[i]), reps)
    if proj == "dense_down":
        pass  # alone only: layer 0's, after its gate-up (cuBLAS)
    elif proj == "qkv":
        for name in ("cublas", "tiled", "resident"):
            fn = projector(name)
            chains[f"norm->{name}"] = time_chain(
                lambda i, fn=fn: fn(rms_norm(x, norm_w, 1e-6, res)[0], ws[i]), reps
            )
        chains["resident with the norm folded"] = time_chain(
            lambda i: resident_gemv(x, ws[i], norm=(norm_w, 1e-6), residual=res), reps
        )
        chains["norm alone"] = time_chain(lambda i: rms_norm(x, norm_w, 1e-6, res), reps)
        same = qk_rope_chains(chains, x, res, norm_w, ws, (heads, kv, d), reps)
        if not same:
            print(f"[{label}] qkv: the epilogue differs from the separate qk_norm_rope", flush=True)
            result["ok"] = False
    else:
        page, ctx = 16, 256
        blocks = ctx // page
        kc = torch.randn(blocks, page, kv, d, dtype=dt, device=dev)
        vc = torch.randn_like(kc)
        table = torch.arange(blocks, dtype=torch.int32, device=dev)[None].expand(tokens, -1).contiguous()
        lens = torch.full((tokens,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(tokens, heads, d, dtype=dt, device=dev)

        def attn():
            return paged_decode(q, kc, vc, table, lens, d**-0.5).reshape(tokens, -1)

        for name in ("cublas", "tiled", "resident"):
            fn = projector(name)
            chains[f"attn->{name}"] = time_chain(lambda i, fn=fn: fn(attn(), ws[i]), reps)
        chains["attn alone"] = time_chain(lambda i: attn(), reps)
    result["chains"][proj] = {key: round(v, 2) for key, v in chains.items()}
    for key, v in chains.items():
        print(f"[{label}] {proj} {n}x{k} {key}: {v:.2f} us", flush=True)
    sweep = {}
    for rows, warps in SWEEP:
        cfg = ResidentConfig(rows, warps)
        try:
            us = time_chain(lambda i, cfg=cfg: resident_gemv(xin, ws[i], config=cfg), reps)
        except Exception as exc:  # a config that does not compile (registers)
            print(f"[{label}] {proj} rows {rows} warps {warps}: {type(exc).__name__}", flush=True)
            continue
        sweep[f"{rows}x{warps}"] = round(us, 2)
        gbps = n * k * 2 / us / 1e3
        print(
            f"[{label}] {proj} resident rows {rows} warps {warps}: {us:.2f} us ({gbps:.0f} GB/s)", flush=True
        )
    result["sweep"][proj] = sweep


def qk_rope_chains(chains: dict, x, res, norm_w, ws, heads: tuple[int, int, int], reps: int) -> bool:
    """The qkv→qk-rope chains into `chains` (µs a repetition); whether the epilogue's rows equal the
    separate launches' bit for bit (a decode step's cos/sin rows, the model's QK-norm weights' shape)."""
    q_heads, kv_heads, d = heads
    tokens, dt, dev = x.shape[0], x.dtype, x.device
    q_w, k_w = (torch.rand(2, d, device=dev) + 0.5).to(dt).unbind(0)
    cos, sin = RotaryEmbedding(d, d // 2, 600000.0, "default").cos_sin(
        torch.arange(tokens, device=dev) + 300, dt
    )
    rope = (heads, (q_w, k_w, 1e-6, cos, sin))

    def separate(i: int) -> torch.Tensor:
        qkv, _ = resident_gemv(x, ws[i], norm=(norm_w, 1e-6), residual=res)
        q, k, _ = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
        qk_norm_rope(q.view(tokens, q_heads, d), k.view(tokens, kv_heads, d), q_w, k_w, 1e-6, cos, sin)
        return qkv

    def fused(i: int) -> torch.Tensor:
        return resident_gemv(x, ws[i], norm=(norm_w, 1e-6), residual=res, rope=rope)[0]

    qkv, _ = resident_gemv(x, ws[0], norm=(norm_w, 1e-6), residual=res)
    q, k, _ = qkv.split([q_heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(tokens, q_heads, d), k.reshape(tokens, kv_heads, d)
    chains["resident normed -> qk_norm_rope"] = time_chain(separate, reps)
    chains["resident normed with the qk-rope epilogue"] = time_chain(fused, reps)
    chains["qk_norm_rope alone"] = time_chain(lambda i: qk_norm_rope(q, k, q_w, k_w, 1e-6, cos, sin), reps)
    return torch.equal(separate(0), fused(0))


def measure_dense(label: str, dims: dict, tp: int, reps: int, dev: torch.device, tokens: int = 1) -> dict:
    """The dense layer's gate-up + SiLU·mul at this rank's shape: the one launch against cuBLAS
    then the SiLU·mul launch (checked against it), alone and after the add + norm, then a sweep."""
    dt, h = torch.bfloat16, dims["hidden_size"]
    inter = dims["intermediate_size"] // tp
    x, res = torch.randn(tokens, h, dtype=dt, device=dev), torch.randn(tokens, h, dtype=dt, device=dev)
    norm_w = torch.randn(h, dtype=dt, device=dev)
    ws = [torch.randn(2 * inter, h, dtype=dt, device=dev) * 0.02 for _ in range(reps)]
    ref = silu_and_mul(F.linear(x, ws[0])).float()
    diff = (silu_gate_up(x, ws[0]).float() - ref).abs().max().item()
    result: dict = {"shape": [2 * inter, h], "max_abs_diff": diff, "ok": True, "chains": {}, "sweep": {}}
    if diff > 0.02 * ref.abs().max().item() + 1e-2:
        print(f"[{label}] dense gate-up differs from cuBLAS + silu_mul by {diff}", flush=True)
        result["ok"] = False
    paths = {"cublas+silu_mul": lambda a, w: silu_and_mul(F.linear(a, w)), "one launch": silu_gate_up}
    chains = {}
    for name, fn in paths.items():
        chains[f"alone {name}"] = time_chain(lambda i, fn=fn: fn(x, ws[i]), reps)
        chains[f"norm->{name}"] = time_chain(
            lambda i, fn=fn: fn(rms_norm(x, norm_w, 1e-6, res)[0], ws[i]), reps
        )
    chains["one launch with the norm folded"] = time_chain(
        lambda i: silu_gate_up(x, ws[i], norm=(norm_w, 1e-6), residual=res), reps
    )
    result["folded"] = check_folded(x, res, norm_w, ws[0])
    if not result["folded"]["ok"]:
        print(f"[{label}] dense gate-up: the folded norm differs from rms_norm then the launch", flush=True)
        result["ok"] = False
    result["chains"] = {key: round(v, 2) for key, v in chains.items()}
    for key, v in chains.items():
        print(f"[{label}] dense gate-up {2 * inter}x{h} {key}: {v:.2f} us", flush=True)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    result["default"] = str(default_tiles(h, inter, 2, sms, tokens))
    for rows, per_sm, warps in DENSE_SWEEP:
        tiles = DenseTiles(rows, min(per_sm * sms, -(-inter // rows)), warps)
        try:
            us = time_chain(lambda i, t=tiles: silu_gate_up(x, ws[i], t), reps)
        except Exception as exc:  # a config that does not compile (registers)
            print(f"[{label}] dense rows {rows} x{per_sm}/SM warps {warps}: {type(exc).__name__}", flush=True)
            continue
        result["sweep"][f"{rows}x{per_sm}x{warps}"] = round(us, 2)
        gbps = 2 * inter * h * 2 / us / 1e3
        print(
            f"[{label}] dense rows {rows} x{per_sm}/SM warps {warps}: {us:.2f} us ({gbps:.0f} GB/s)",
            flush=True,
        )
    return result


def check_folded(x, res, norm_w, w) -> dict:
    """The folded launch (`silu_gate_up` with norm and residual) against `rms_norm` then the launch:
    the residual sum bit for bit, the output bit for bit at one token (the fold's rule), within
    bf16 rounding at two (its loop's sums ordered otherwise); the fraction of outputs bit-equal."""
    got, total = silu_gate_up(x, w, norm=(norm_w, 1e-6), residual=res)
    normed, want_total = rms_norm(x, norm_w, 1e-6, res)
    want = silu_gate_up(normed, w)
    same = (got == want).float().mean().item()
    close = torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    ok = torch.equal(total, want_total) and (same == 1.0 if x.shape[0] == 1 else close)
    return {"same_bits": round(same, 6), "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20, help="repetitions a graph, each with its own weights")
    ap.add_argument("--tokens", type=int, default=1, help="rows a projection (the kernel serves 1 or 2)")
    ap.add_argument("--force", action="store_true", help="time the shapes past the resident budget too")
    ap.add_argument("--dense-only", action="store_true", help="the dense gate-up part alone")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    print(f"PDL {'on' if pdl.enabled(dev) else 'off'}; {torch.cuda.get_device_name(dev)}", flush=True)
    out: dict = {"device": torch.cuda.get_device_name(dev), "pdl": pdl.enabled(dev), "tokens": args.tokens}
    models = {"ling-mini tp1": (LING_MINI, 1), "ming-flash tp2": (MING_FLASH, 2)}
    for label, (dims, tp) in models.items():
        result = (
            {"ok": True}
            if args.dense_only
            else run_model(label, dims, tp, args.reps, dev, args.force, args.tokens)
        )
        result["dense_gate_up"] = measure_dense(label, dims, tp, args.reps, dev, args.tokens)
        result["ok"] = result["ok"] and result["dense_gate_up"]["ok"]
        out[label] = result
    if args.out:
        write_result(args.out, out, gpu=True)  # CUDA only: the script needs a GPU
    return 0 if all(out[m]["ok"] for m in models) else 1


if __name__ == "__main__":
    sys.exit(main())
