"""The MoE layer's decode kernels on one GPU at a decode batch's shapes: the router's paths, the expert
alignment, and the two expert GEMMs under a tile sweep.

    source bench/device_env.sh && python3 bench/moe_decode_gpu.py --out $OUT/moe_decode.json
    run("source bench/device_env.sh && python3 bench/moe_decode_gpu.py --out $OUT/moe_decode.json",
        kind="nvidia-h200", carry=[".cache/transport-whl"])   # ~5 min: --sweep-s 90 a shape
    ... --sections router --tokens 1,2,4,8   # the router's paths alone

For Ling-mini (TP=1) and Ming-flash's thinker at TP=2 (one rank's expert slices; the router is
replicated), 256 experts, top-8, the shared expert folded in as a routed run where `fused_experts`
folds it, at T = 1 … 64 tokens in bf16. Every time is µs a call from CUDA events over replays of a
CUDA graph of CALLS calls, each call on its own routing (so the experts' weights come from HBM,
not from the previous call's L2), no launch cost:
- the router: `route`'s gemv path (CUDA-core products, T ≤ 16: all T tokens in one block as
  `gemv_us`, in blocks of 1, 2, 4 tokens as `gemv_b*_us`, for router.ROUTE_TABLE), its tiled dot path (default
  tiles, then the best of a tile sweep within --router-sweep-s, per T: for router.DOT_TILES) and
  the cuBLAS path (fp32 casts + GEMM + select), and how many tokens of the dot path pick the
  reference's experts (one gate weight for all calls: its 1-2 MB may sit in L2);
- the alignment (with the shared run): one program (up to 128 pairs) and the multi-launch layout;
- the whole `fused_experts` with the shared expert folded in and not (`moe` rows: for
  fused_moe.SHARED_FOLD_MAX_PAIRS);
- the expert GEMMs: gate-up and down each under a sweep of (BLOCK_M, BLOCK_N, BLOCK_K, warps,
  stages) within --sweep-s, against `rule_tiles`; per (shape, pairs bucket) the best block_m of
  both and a PASTE line for fused_moe.TILES.
Writes JSON to --out. Exit status 1 when any timed router path (dot, gemv in any block) disagrees with the
reference's routing on more than 1 % of tokens (near-ties flip rarely: fp32 sums in another order).
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from unittest import mock

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import LING_MINI, MING_FLASH
from omnistage.services.thinker.kernels import fused_moe, moe_align, router
from omnistage.services.thinker.kernels.fused_moe import GemmTiles, MoeTiles, gemm_meta, rule_tiles
from omnistage.services.thinker.kernels.moe_align import align_by_expert
from omnistage.services.thinker.kernels.router import RouterTiles
from omnistage.services.thinker.models.layers.moe import Router

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the graph timer
from graph_timing import graph_time_us  # noqa: E402

CALLS = 20  # calls per captured graph, each on its own routing
GEMV_BLOCKS = (1, 2, 4)  # the router's gemv path in token blocks this small (router.ROUTE_TABLE)
DEVICE, DTYPE = "cuda", torch.bfloat16
TOKENS = (1, 2, 4, 8, 16, 32, 64)
GEMM_SWEEP = dict(
    block_m=(16, 32), block_n=(16, 32, 64, 128), block_k=(64, 128, 256), warps=(4, 8), stages=(2, 3, 4)
)
# --space prefill: a prefill step's token counts (one per pairs bucket of fused_moe.TILES: T=64 is a
# short prompt, 512 eight of them arriving together, 2048 thirty-two, 4096 a full chunk) and larger
# tiles; a block_m above twice an expert's mean rows only pads (`block_m_fits`).
PREFILL_TOKENS = (64, 128, 256, 512, 1024, 2048, 4096)
GEMM_SWEEP_PREFILL = dict(
    block_m=(16, 32, 64, 128), block_n=(64, 128, 256), block_k=(64, 128), warps=(4, 8), stages=(2, 3, 4)
)
# What a run times (--sections); a prefill space the GEMMs only.
SECTIONS = ("router", "align", "moe", "gemm")
ROUTER_SWEEP = dict(
    block_e=(16, 32, 64), block_k=(64, 128, 256), split=(1, 2, 4, 8), warps=(4, 8), stages=(2, 3)
)


def moe_shape(dims: dict, tp: int) -> dict:
    """One rank's MoE sizes: the experts' intermediate split over TP, the router replicated."""
    return dict(
        experts=dims["num_experts"],
        hidden=dims["hidden_size"],
        inter=dims["moe_intermediate_size"] // tp,
        top_k=dims["num_experts_per_tok"],
        groups=dims["n_group"],
        topk_group=dims["topk_group"],
    )


SHAPES = {"ling-mini tp1": moe_shape(LING_MINI, 1), "ming-flash tp2": moe_shape(MING_FLASH, 2)}


def time_us(fns: list[Callable[[], object]], replays: int = 10) -> float:
    """µs a call, each of `fns` (CALLS of them) once in one captured graph."""
    return graph_time_us(fns, replays)


def routings(t: int, shape: dict) -> list[torch.Tensor]:
    """CALLS random routings [t, top_k] (distinct experts per token, int64 as the router gives)."""
    e, k = shape["experts"], shape["top_k"]
    return [torch.rand(t, e, device=DEVICE).argsort(dim=1)[:, :k].contiguous() for _ in range(CALLS)]


class RouterCase:
    """One shape and token count's router: a bf16 gate, CALLS inputs, the launch's arguments."""

    def __init__(self, shape: dict, t: int) -> None:
        e, h = shape["experts"], shape["hidden"]
        self.t = t
        self.gate = Router(h, e, shape["top_k"], shape["groups"], shape["topk_group"], 2.5)
        self.gate.to(DEVICE, DTYPE)
        self.gate.weight.data.normal_(0, 0.02)
        self.gate.expert_bias.data.normal_(0, 0.01)
        self.xs = [torch.randn(t, h, device=DEVICE, dtype=DTYPE) for _ in range(CALLS)]
        g = self.gate
        self.args = (g.weight, g.expert_bias, g.top_k, g.n_group, g.topk_group, g.scaling)

    def time(self, path: str, tiles: RouterTiles | None = None, block_t: int | None = None) -> float:
        return time_us(
            [
                lambda x=x: router.route(x, *self.args, path=path, tiles=tiles, block_t=block_t)
                for x in self.xs
            ]
        )

    def same_tokens(self, path: str = "dot", block_t: int | None = None) -> float:
        """The share of tokens whose experts on `path` (in `block_t` token blocks) are the
        reference's (fp32 GEMM). Every timed path is checked: a gemv block of two tokens once picked
        duplicate experts on the H200 while the CPU interpreter agreed."""
        same = 0
        for x in self.xs:
            want = self.gate(x)[1]
            got = router.route(x, *self.args, path=path, block_t=block_t)[1]
            same += int((got == want).all(dim=1).sum())
        return round(same / (self.t * CALLS), 4)


def bench_router(name: str, shape: dict, tokens: tuple[int, ...], budget_s: float) -> list[dict]:
    """The router's paths per token count, the dot path's agreement with the reference, and the
    dot path's best tiles per token count from a sweep within `budget_s`."""
    cases = [RouterCase(shape, t) for t in tokens]
    e, h = shape["experts"], shape["hidden"]
    timers = {
        c.t: lambda cfg, c=c: (
            c.time("dot", cfg) if cfg.block_e <= e and cfg.block_k * cfg.split <= 2 * h else None
        )
        for c in cases
    }
    best = sweep(sweep_configs(ROUTER_SWEEP, RouterTiles), timers, budget_s, lambda cfg: 0)
    rows = []
    for c in cases:
        row = dict(
            model=name, tokens=c.t, cublas_us=round(c.time("cublas"), 2), dot_us=round(c.time("dot"), 2)
        )
        if c.t <= 16:
            row["path"] = router.route_path(c.xs[0], c.gate.weight)
            row["gemv_us"] = round(c.time("gemv", block_t=c.t), 2)  # every token in one block
            row["gemv_same_tokens"] = c.same_tokens("gemv", c.t)
            for block_t in GEMV_BLOCKS:
                if block_t < c.t:
                    row[f"gemv_b{block_t}_us"] = round(c.time("gemv", block_t=block_t), 2)
                    row[f"gemv_b{block_t}_same_tokens"] = c.same_tokens("gemv", block_t)
        row["dot_same_tokens"] = c.same_tokens()
        if (c.t, 0) in best:
            us, cfg = best[c.t, 0]
            row.update(dot_best_us=round(us, 2), dot_best_tiles=asdict(cfg))
        print(f"router {name:15s} T={c.t:3d}  {row}", flush=True)
        rows.append(row)
    return rows


def sweep(
    configs: list, timers: dict[object, Callable[[object], float | None]], budget_s: float, group: Callable
) -> dict[tuple[object, object], tuple[float, object]]:
    """The best config per (timer key, group(config)): configs in order until `budget_s` runs out,
    each timed by every timer (None: it does not fit that case; an exception: the compiler refused
    it, the config is dropped)."""
    best: dict[tuple[object, object], tuple[float, object]] = {}
    deadline, tried = time.monotonic() + budget_s, 0
    for cfg in configs:
        if time.monotonic() > deadline:
            break
        tried += 1
        for key, timer in timers.items():
            try:
                us = timer(cfg)
            except Exception as exc:  # registers, shared memory
                print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
                break
            slot = (key, group(cfg))
            if us is not None and (slot not in best or us < best[slot][0]):
                best[slot] = (us, cfg)
    print(f"sweep: {tried} of {len(configs)} configs timed", flush=True)
    return best


def sweep_configs(space: dict, make: Callable) -> list:
    """Every combination of `space` as `make(*values)`, in a fixed random order (a sweep cut short
    still samples the space)."""
    configs = [make(*values) for values in itertools.product(*space.values())]
    random.Random(0).shuffle(configs)
    return configs


def one_program_limit(pairs: int):
    """moe_align.ONE_PROGRAM_MAX_PAIRS set for a timing: huge (one program) or 0 (multi-launch)."""
    return mock.patch.object(moe_align, "ONE_PROGRAM_MAX_PAIRS", pairs)


def bench_align(name: str, shape: dict, t: int, ids: list[torch.Tensor]) -> dict:
    """The alignment of t tokens' pairs with the shared run appended (as the fused path folds it),
    by one program and by the multi-launch layout, at block_m 16; `one_program`: the layout the
    fused path takes at this size (moe_align.ONE_PROGRAM_MAX_PAIRS)."""
    e, n = shape["experts"], t * shape["top_k"]
    row = dict(model=name, tokens=t, pairs=n, one_program=moe_align.one_program(n, True))
    for key, limit in (("multi_launch_us", 0), ("one_program_us", 10**6)):
        if limit or n <= 128:  # one program past 128 pairs: slower than the launches it saves
            with one_program_limit(limit):
                row[key] = round(time_us([lambda i=i: align_by_expert(i, e, 16, True, t) for i in ids]), 2)
    print(f"align  {name:15s} T={t:3d} pairs {n:4d}  {row}", flush=True)
    return row


def bench_fold(name: str, shape: dict, t: int, ids: list[torch.Tensor], weights: tuple) -> dict:
    """`fused_experts` (alignment, both GEMMs, the sum) with the shared expert folded in as a run
    and as its own cuBLAS GEMMs + SiLU·mul (fused_moe.SHARED_FOLD_MAX_PAIRS's choice per size)."""
    w13, w2, shared = weights
    x = torch.randn(t, shape["hidden"], device=DEVICE, dtype=DTYPE)
    routing = torch.rand(t, shape["top_k"], device=DEVICE)
    n = t * shape["top_k"]
    row = dict(model=name, tokens=t, pairs=n, folds=fused_moe.folds_shared(n, True))
    for key, limit in (("folded_us", 10**6), ("unfolded_us", 0)):
        with mock.patch.object(fused_moe, "SHARED_FOLD_MAX_PAIRS", limit):
            calls = [lambda i=i: fused_moe.fused_experts(x, w13, w2, routing, i, shared) for i in ids]
            row[key] = round(time_us(calls, replays=5), 2)
    print(f"moe    {name:15s} T={t:3d} pairs {n:4d}  {row}", flush=True)
    return row


def expert_weights(shape: dict) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """bf16 w13 [E, 2I, H], w2 [E, H, I] and a shared expert of an expert's shape."""
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    w13 = torch.randn(e, 2 * i, h, device=DEVICE, dtype=DTYPE) * 0.02
    w2 = torch.randn(e, h, i, device=DEVICE, dtype=DTYPE) * 0.02
    return w13, w2, (torch.randn_like(w13[0]), torch.randn_like(w2[0]))


class GemmCase:
    """One shape and token count's expert GEMMs: inputs, CALLS layouts per block_m, outputs."""

    def __init__(self, shape: dict, t: int, w13: torch.Tensor, w2: torch.Tensor, shared: tuple, ids: list):
        self.shape, self.t, self.w13, self.w2 = shape, t, w13, w2
        k = shape["top_k"]
        self.n = t * k
        self.fold = fused_moe.folds_shared(self.n, True)  # the decode step folds the shared expert in
        self.shared = shared if self.fold else (None, None)
        rows = self.n + (t if self.fold else 0)
        self.x = torch.randn(t, shape["hidden"], device=DEVICE, dtype=DTYPE)
        self.h = torch.randn(rows, shape["inter"], device=DEVICE, dtype=DTYPE)
        self.out = torch.empty(rows, shape["hidden"], device=DEVICE, dtype=torch.float32)
        self.routing = torch.rand(self.n, device=DEVICE)
        self.ids, self.layouts = ids, {}
        self.rule_us: dict[str, float] = {}

    def layout(self, block_m: int) -> list[tuple[torch.Tensor, ...]]:
        if block_m not in self.layouts:
            extra = self.t if self.fold else 0
            self.layouts[block_m] = [
                align_by_expert(i, self.shape["experts"], block_m, True, extra) for i in self.ids
            ]
        return self.layouts[block_m]

    def time(self, gemm: str, block_m: int, tiles: GemmTiles) -> float:
        meta = gemm_meta(block_m, tiles, self.shape["experts"], DTYPE)
        k, n = self.shape["top_k"], self.n
        if gemm == "gate_up":
            calls = [
                lambda lay=lay: fused_moe._expert_gemm(
                    self.x, self.w13, self.h, lay, meta, num_pairs=n, shared_w=self.shared[0], pairs_per_row=k
                )
                for lay in self.layout(block_m)
            ]
        else:
            calls = [
                lambda lay=lay: fused_moe._expert_gemm(
                    self.h,
                    self.w2,
                    self.out,
                    lay,
                    meta,
                    num_pairs=n,
                    shared_w=self.shared[1],
                    weights=self.routing,
                )
                for lay in self.layout(block_m)
            ]
        return time_us(calls, replays=5)


def gemm_fits(cfg: tuple, shape: dict, gemm: str) -> bool:
    """A tile worth timing: no wider than the GEMM's N, two reduction steps at least."""
    _, block_n, block_k, _, _ = cfg
    n, k = (shape["inter"], shape["hidden"]) if gemm == "gate_up" else (shape["hidden"], shape["inter"])
    return block_n <= n and 2 * block_k <= k


def block_m_fits(block_m: int, case: GemmCase) -> bool:
    """A row block worth timing: 16 always, a larger one up to twice an expert's mean rows."""
    return block_m == 16 or block_m <= 2 * case.n / case.shape["experts"]


def gemm_timers(cases: list[GemmCase]) -> dict[tuple[int, str], Callable[[tuple], float | None]]:
    """A sweep timer per (tokens, gemm): cfg (block_m, block_n, block_k, warps, stages) → µs."""

    def timer(case: GemmCase, gemm: str) -> Callable[[tuple], float | None]:
        return lambda cfg: (
            case.time(gemm, cfg[0], GemmTiles(*cfg[1:]))
            if gemm_fits(cfg, case.shape, gemm) and block_m_fits(cfg[0], case)
            else None
        )

    return {(c.t, g): timer(c, g) for c in cases for g in ("gate_up", "down")}


def bench_gemms(
    name: str,
    shape: dict,
    tokens: tuple[int, ...],
    ids: dict,
    weights: tuple,
    budget_s: float,
    space: dict = GEMM_SWEEP,
) -> list[dict]:
    """Per token count: the rule's tiles and the sweep's best (block_m shared by both GEMMs), with a
    PASTE line for fused_moe.TILES; then the whole `fused_experts` (alignment, both GEMMs, the sum,
    the shared expert) under the rule's tiles and the best, in one graph each (`moe_*_us`)."""
    e, h, i = shape["experts"], shape["hidden"], shape["inter"]
    w13, w2, shared = weights
    cases = [GemmCase(shape, t, w13, w2, shared, ids[t]) for t in tokens]
    rows = []
    for case in cases:
        rule = rule_tiles(case.n, e)
        case.rule_us = {g: case.time(g, rule.block_m, getattr(rule, g)) for g in ("gate_up", "down")}
    best = sweep(sweep_configs(space, lambda *v: v), gemm_timers(cases), budget_s, lambda cfg: cfg[0])
    for case in cases:
        pick = None
        for block_m in space["block_m"]:
            both = [best.get(((case.t, g), block_m)) for g in ("gate_up", "down")]
            if all(both) and (pick is None or both[0][0] + both[1][0] < pick[1]):
                pick = (block_m, both[0][0] + both[1][0], both)
        row = dict(model=name, tokens=case.t, pairs=case.n, folded=case.fold)
        row.update({f"rule_{g}_us": round(us, 2) for g, us in case.rule_us.items()})
        if pick is not None:
            block_m, total, ((gu_us, gu), (dn_us, dn)) = pick
            tiles = MoeTiles(block_m, GemmTiles(*gu[1:]), GemmTiles(*dn[1:]))
            row.update(best_gate_up_us=round(gu_us, 2), best_down_us=round(dn_us, 2), best=asdict(tiles))
            row.update(moe_tiles_us(case, weights, rule_tiles(case.n, e), tiles))
            key = (e, i, h, fused_moe.pairs_bucket(case.n))
            rule_total = sum(case.rule_us.values())
            print(
                f"PASTE     {key}: {tiles},  # {name} T={case.t}: {total:.1f} us vs the rule's {rule_total:.1f}",
                flush=True,
            )
        print(f"gemm   {name:15s} T={case.t:3d}  {row}", flush=True)
        rows.append(row)
    return rows


def moe_tiles_us(case: GemmCase, weights: tuple, rule: MoeTiles, best: MoeTiles) -> dict:
    """`fused_experts` end to end (as the engine runs it at this size) under each tile choice."""
    w13, w2, shared = weights
    routing = torch.rand(case.t, case.shape["top_k"], device=DEVICE)
    out = {}
    for key, tiles in (("moe_rule_us", rule), ("moe_best_us", best)):
        calls = [
            lambda i=i, tiles=tiles: fused_moe.fused_experts(case.x, w13, w2, routing, i, shared, tiles=tiles)
            for i in case.ids
        ]
        out[key] = round(time_us(calls, replays=5), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="moe_decode.json")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated of: " + ", ".join(SHAPES))
    ap.add_argument("--sweep-s", type=float, default=90.0, help="GEMM tile sweep time per shape (0: none)")
    ap.add_argument("--router-sweep-s", type=float, default=20.0, help="router tile sweep time per shape")
    ap.add_argument(
        "--space",
        choices=("decode", "prefill"),
        default="decode",
        help="prefill: PREFILL_TOKENS (unless --tokens) and larger tiles; the expert GEMMs only",
    )
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help="comma-separated of: " + ", ".join(SECTIONS) + " (e.g. router alone)",
    )
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    prefill = args.space == "prefill"
    asked = set(args.sections.split(","))
    if asked - set(SECTIONS):
        ap.error(f"--sections: {', '.join(sorted(asked - set(SECTIONS)))} not among {', '.join(SECTIONS)}")
    run = asked & ({"gemm"} if prefill else set(SECTIONS))
    if prefill and args.tokens == ",".join(map(str, TOKENS)):
        args.tokens = ",".join(map(str, PREFILL_TOKENS))
    tokens = tuple(int(t) for t in args.tokens.split(",") if t)
    print("device", torch.cuda.get_device_name(0), "tuned", sorted(fused_moe.TILES), flush=True)
    result: dict = dict(
        device=torch.cuda.get_device_name(0), calls_per_graph=CALLS, router=[], align=[], moe=[], gemm=[]
    )
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        ids = {t: routings(t, shape) for t in tokens}
        if "router" in run:
            result["router"] += bench_router(name, shape, tokens, args.router_sweep_s)
        if "align" in run:
            result["align"] += [bench_align(name, shape, t, ids[t]) for t in tokens]
        weights = expert_weights(shape)
        if "moe" in run:
            result["moe"] += [bench_fold(name, shape, t, ids[t], weights) for t in tokens]
        if "gemm" in run:
            space = GEMM_SWEEP_PREFILL if prefill else GEMM_SWEEP
            result["gemm"] += bench_gemms(name, shape, tokens, ids, weights, args.sweep_s, space)
        del weights
        torch.cuda.empty_cache()
    write_result(args.out, result, gpu=True)  # CUDA only: the script needs a GPU
    worst = min((v for r in result["router"] for k, v in r.items() if k.endswith("same_tokens")), default=1.0)
    print(f"SUMMARY router agreement with the reference, every path (worst) {worst:.4f}", flush=True)
    return 1 if worst < 0.99 else 0


if __name__ == "__main__":
    sys.exit(main())
