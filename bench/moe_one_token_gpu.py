"""One token's MoE layer on one GPU: the aligned path (alignment, two tensor-core expert GEMMs, the
combine) against `kernels/moe_one_token.py` (two launches, the down weights read before the wait).

    source bench/device_env.sh && python3 bench/moe_one_token_gpu.py --out $OUT/moe_one_token.json

At Ling-mini TP=1's and Ming-flash TP=2's per-rank shapes (256 experts, top-8, one shared expert),
bf16: µs a layer of `router → experts` (the router launch before the experts, as in a decode step:
what the down weights' early reads overlap), captured `--layers` times in one CUDA graph with a
layer's own weights each (the chosen experts are never in L2 from the layer before), the gate-up
streamed (the default) against a program a tile, then sweeps of the streaming tiles, of the down
rows and warps beside them, and (unless `--no-sweep`) of a program a tile's. Exit status 1 when the paths differ by more than bf16 rounding
or the streaming gate-up changes a bit.

`select` (issue 40; `--select-only`: these rows alone): the decode step's one-token MoE layer in its
place -- the add + RMSNorm in the router's launch -- as today (`router.normed_route`: the router's last
program selects; the down reads the ids and its chosen rows before its wait) against the experts
selected in the streaming gate-up (`gate_up_select.normed_select_experts`: the router's logits only,
the down reading the ids after its wait -- and with the ids-ready flag, OMNISTAGE_THINKER_DOWN_FLAG's
default, the ids and its chosen rows before it where the gate-up's flag is seen, `ready_flag.py`),
µs a layer and of each router launch alone, the registers of the launches' compiled variants, and
whether the ids, routing weights, output and residual sum are bit-equal, with the flag and without,
and the flag word zero after (exit status 1 when not).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import LING_MINI, MING_FLASH_TP2_RANK
from omnistage.services.thinker.kernels import moe_one_token, ready_flag
from omnistage.services.thinker.kernels import router as router_kernels
from omnistage.services.thinker.kernels.fused_moe import choose_tiles, fused_experts
from omnistage.services.thinker.kernels.gate_up_select import normed_select_experts
from omnistage.services.thinker.kernels.moe_one_token import (
    OneTokenTiles,
    RouterLogits,
    default_tiles,
    one_token_experts,
    selecting_experts,
)
from omnistage.services.thinker.kernels.router import normed_logits, normed_route, route

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the chain timer
from resident_gemv_gpu import time_chain  # noqa: E402

SWEEP = [OneTokenTiles(g, d, w) for w in (4, 8) for g in (2, 4, 8, 16) for d in (2, 4, 8)]
# The streaming gate-up (OneTokenTiles.programs): rows a tile x programs an SM, on the default down tiles.
STREAM = [(rows, per_sm) for rows in (2, 4) for per_sm in (2, 4, 6)]
# The down launch's rows a program and both launches' warps, beside the default streaming gate-up.
DOWN = [(rows, warps) for warps in (4, 8) for rows in (1, 2, 4, 8, 16)]


def run(label: str, dims: dict, layers: int, dev: torch.device, sweep: bool = True) -> dict:
    dt = torch.bfloat16
    e, h, i, k = (
        dims["num_experts"],
        dims["hidden_size"],
        dims["moe_intermediate_size"],
        dims["num_experts_per_tok"],
    )
    groups, top_groups = dims["n_group"], dims["topk_group"]
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, generator=g, device=dev) * 0.02).to(dt)

    weights = [
        dict(
            gate=rand(e, h),
            bias=torch.zeros(e, device=dev),
            w13=rand(e, 2 * i, h),
            w2=rand(e, h, i),
            shared=(rand(2 * i, h), rand(h, i)),
        )
        for _ in range(layers)
    ]
    x = (torch.randn(1, h, generator=g, device=dev)).to(dt)
    aligned_tiles = choose_tiles(k, e, i, h)

    def layer(n: int, experts) -> torch.Tensor:
        w = weights[n]
        rw, ids = route(x, w["gate"], w["bias"], k, groups, top_groups, 2.5)
        return experts(w, rw, ids)

    def aligned(w, rw, ids):
        return fused_experts(x, w["w13"], w["w2"], rw, ids, w["shared"], fuse=True, tiles=aligned_tiles)

    def one_token(tiles):
        return lambda w, rw, ids: one_token_experts(x, w["w13"], w["w2"], rw, ids, w["shared"], tiles)

    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    plain_tiles = default_tiles(h, i, k, 2)  # a program a tile
    a, b = layer(0, aligned), layer(0, one_token(None))
    diff = (a.float() - b.float()).abs().max().item()
    ok = diff <= 0.02 * a.float().abs().max().item() + 1e-2
    result = {
        "shape": dict(experts=e, hidden=h, intermediate=i, top_k=k),
        "max_abs_diff": diff,
        "ok": ok,
        "default_tiles": vars(default_tiles(h, i, k, 2, sms=sms)),
        "us_a_layer": {
            "router + aligned (align, gate-up, down, combine)": time_chain(
                lambda n: layer(n, aligned), layers
            ),
            "router + one token (gate-up, down)": time_chain(lambda n: layer(n, one_token(None)), layers),
            "router + one token, a gate-up program a tile": time_chain(
                lambda n: layer(n, one_token(plain_tiles)), layers
            ),
            "router alone": time_chain(
                lambda n: route(x, weights[n]["gate"], weights[n]["bias"], k, groups, top_groups, 2.5), layers
            ),
        },
        "sweep": {},
        "stream": {},
    }
    for key, us in result["us_a_layer"].items():
        print(f"[{label}] {key}: {us:.2f} us", flush=True)
    print(
        f"[{label}] max abs diff aligned vs one token: {diff:.4g} ({'ok' if ok else 'TOO LARGE'})", flush=True
    )
    if not torch.equal(b, layer(0, one_token(plain_tiles))):  # the same sums, in the same order
        result["ok"] = False
        print(f"[{label}] the streaming gate-up is NOT bit-equal to a program a tile", flush=True)
    for rows, per_sm in STREAM:
        tiles = replace(plain_tiles, gate_up_rows=rows, programs=per_sm * sms)
        us = time_chain(lambda n, tiles=tiles: layer(n, one_token(tiles)), layers)
        result["stream"][f"{rows}/{per_sm}"] = round(us, 2)
        print(f"[{label}] streaming gate-up rows {rows}, {per_sm} programs an SM: {us:.2f} us", flush=True)
    streamed = default_tiles(h, i, k, 2, sms=sms)
    result["down"] = {}
    for rows, warps in DOWN:
        tiles = replace(streamed, down_rows=rows, warps=warps)
        try:
            us = time_chain(lambda n, tiles=tiles: layer(n, one_token(tiles)), layers)
        except Exception as exc:  # a tile that does not compile (registers)
            print(f"[{label}] down rows {rows} warps {warps}: {type(exc).__name__}", flush=True)
            continue
        result["down"][f"{rows}/{warps}"] = round(us, 2)
        print(f"[{label}] streaming gate-up, down rows {rows}, {warps} warps: {us:.2f} us", flush=True)
    for tiles in SWEEP if sweep else []:
        try:
            us = time_chain(lambda n, tiles=tiles: layer(n, one_token(tiles)), layers)
        except Exception as exc:  # a tile that does not compile (registers, shared memory)
            print(f"[{label}] {tiles}: {type(exc).__name__}", flush=True)
            continue
        result["sweep"][f"{tiles.gate_up_rows}/{tiles.down_rows}/{tiles.warps}"] = round(us, 2)
        print(
            f"[{label}] one token gate-up rows {tiles.gate_up_rows} down rows {tiles.down_rows} warps {tiles.warps}: {us:.2f} us",
            flush=True,
        )
    return result


KERNELS = {
    "router": router_kernels._route_kernel,
    "gate-up (stream)": moe_one_token._one_token_gate_up_stream_kernel,
    "down": moe_one_token._one_token_down_kernel,
}


def _registers() -> dict[str, dict[str, str]]:
    """Each launch's variants compiled in this process (Triton's JIT caches, by their key): registers
    and spills a thread (best effort: the caches' layout is Triton's own)."""
    found: dict[str, dict[str, str]] = {}
    for name, kernel in KERNELS.items():
        found[name] = {}
        try:
            for cache in getattr(kernel, "device_caches", {}).values():
                for key, compiled in (cache[0] if isinstance(cache, tuple) else cache).items():
                    found[name][str(key)] = f"{compiled.n_regs} registers, {compiled.n_spills} spills"
        except Exception as exc:  # another Triton's caches
            found[name]["?"] = f"{type(exc).__name__}: {exc}"
    return found


class _SelectLayers:
    """`layers` one-token MoE layers of `dims` (their own weights each) on one row, and each path of
    a layer: today's (router selects), the gate-up selecting (the down's ids after its wait, or with
    the ids-ready flag before it), and each router launch alone."""

    def __init__(self, dims: dict, layers: int, dev: torch.device) -> None:
        e, h, i = dims["num_experts"], dims["hidden_size"], dims["moe_intermediate_size"]
        k, groups, top_groups = dims["num_experts_per_tok"], dims["n_group"], dims["topk_group"]
        g = torch.Generator(device=dev).manual_seed(2)

        def rand(*shape, scale=0.02):
            return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

        self.weights = [
            dict(
                gate=rand(e, h),
                bias=torch.randn(e, generator=g, device=dev) * 0.01,
                norm=rand(h, scale=1.0),
                experts=(rand(e, 2 * i, h), rand(e, h, i)),
                shared=(rand(2 * i, h), rand(h, i)),
            )
            for _ in range(layers)
        ]
        self.x, self.residual = rand(1, h, scale=1.0), rand(1, h, scale=1.0)
        self.route_shape = (k, groups, top_groups, 2.5)

    def router_selecting(self, n: int):  # today's router launch
        w = self.weights[n]
        return normed_route(self.x, self.residual, w["norm"], 1e-6, w["gate"], w["bias"], *self.route_shape)

    def router_logits(self, n: int):  # the logits-only router launch
        w, (k, groups, top_groups, _) = self.weights[n], self.route_shape
        return normed_logits(
            self.x, self.residual, w["norm"], 1e-6, w["gate"], w["bias"], groups, top_groups, k
        )

    def today(self, n: int):
        rw, ids, normed, total = self.router_selecting(n)
        w = self.weights[n]
        return one_token_experts(normed, *w["experts"], rw, ids, w["shared"]), total, rw, ids

    def selecting(self, n: int, flag: bool = False):
        logits, normed, total = self.router_logits(n)
        w, (k, groups, top_groups, scaling) = self.weights[n], self.route_shape
        select = RouterLogits(logits, w["bias"], groups, top_groups, k, scaling)
        out, rw, ids = selecting_experts(normed, *w["experts"], select, w["shared"], flag=flag)
        return out, total, rw, ids

    def layer(self, n: int, flag: bool = False):  # the model's entry: its rule, then the three launches
        w = self.weights[n]
        args = (self.x, self.residual, w["norm"], 1e-6, w["gate"], w["bias"], self.route_shape)
        return normed_select_experts(*args, w["experts"], w["shared"], flag=flag)

    def flagged(self, n: int):  # the down reading the ids and its rows before its wait on the flag
        return self.layer(n, flag=True)

    def bits(self, layers: int) -> dict[str, bool]:
        """Whether the selecting paths (without and with the flag) give today's bits, the flag word
        zero after."""
        bits: dict[str, bool] = {}
        names = ("output", "residual sum", "routing weights", "ids")
        for flag in (False, True):
            tag = " (flag)" if flag else ""
            for n in range(layers):
                for name, a, b in zip(names, self.today(n), self.selecting(n, flag), strict=True):
                    bits[name + tag] = bits.get(name + tag, True) and torch.equal(a, b)
            served, want = self.layer(0, flag), self.today(0)
            bits["the rule served, the same bits" + tag] = served is not None and all(
                torch.equal(a, b) for a, b in zip(served, want[:2], strict=True)
            )
        bits["the flag word zero after"] = not ready_flag.flag_for(self.x.device).any().item()
        return bits


def select_rows(label: str, dims: dict, layers: int, dev: torch.device) -> dict:
    """Today's one-token MoE layer (router selects) against the gate-up selecting, without and with
    the ids-ready flag, in one graph each."""
    paths = _SelectLayers(dims, layers, dev)
    paths.today(0)
    before = _registers()
    paths.selecting(0)  # the variants compiled here are the selecting path's (with the flag and without)
    paths.selecting(0, flag=True)
    after = _registers()
    registers = {
        name: {
            "selecting": [v for key, v in after[name].items() if key not in before[name]],
            "every variant so far": sorted(set(after[name].values())),
        }
        for name in KERNELS
    }
    bits = paths.bits(layers)
    result = {
        "bits": bits,
        "ok": all(bits.values()),
        "us_a_layer": {
            "today: router selects + gate-up + down (ids before its wait)": time_chain(paths.today, layers),
            "gate-up selects: router logits + gate-up selecting + down (ids after its wait)": time_chain(
                paths.layer, layers
            ),
            "gate-up selects + flag: ... + down (ids and rows before its wait on the flag)": time_chain(
                paths.flagged, layers
            ),
            "router alone, selecting (ticket + last program)": time_chain(paths.router_selecting, layers),
            "router alone, logits only": time_chain(paths.router_logits, layers),
        },
        "registers": registers,
    }
    for key, us in result["us_a_layer"].items():
        print(f"[{label}] select: {key}: {us:.2f} us", flush=True)
    print(f"[{label}] select: bits {bits}", flush=True)
    for key, regs in result["registers"].items():
        print(f"[{label}] select: {key} registers {regs}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6, help="layers a graph, each with its own weights")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--no-sweep", action="store_true", help="not the sweep of a program a tile")
    ap.add_argument("--select-only", action="store_true", help="the gate-up selection's rows alone")
    args = ap.parse_args()
    dev = torch.device("cuda")
    out: dict = {"device": torch.cuda.get_device_name(dev)}
    for key, dims in (("ling-mini tp1", LING_MINI), ("ming-flash tp2 rank", MING_FLASH_TP2_RANK)):
        if not args.select_only:
            out[key] = run(key, dims, args.layers, dev, not args.no_sweep)
        out[f"{key} select"] = select_rows(key, dims, args.layers, dev)
    if args.out:
        write_result(args.out, out, gpu=True)  # CUDA only: the script needs a GPU
    return 0 if all(v["ok"] for key, v in out.items() if key != "device") else 1


if __name__ == "__main__":
    sys.exit(main())
