"""The router of one token on one GPU, in its decode-step place: the MoE layer's add + RMSNorm and
gate GEMV and selection in one launch (`router.normed_route`), then the token's experts
(`moe_one_token.one_token_experts`), across the gemv path's tilings (`router.GemvTiles`: experts a
program, warps a program).

    source bench/device_env.sh && python3 bench/router_one_token_gpu.py --out $OUT/router_one_token.json

At Ling-mini TP=1's and Ming-flash TP=2's per-rank shapes, bf16: µs a layer of `router → experts`
and of the router alone, captured `--layers` times in one CUDA graph with a layer's own weights
each. Each tiling's ids and weights are compared with the default's (`bits`: equal or not; the
hidden chunk follows the experts a program, so the fp32 sums may round apart).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import LING_MINI, MING_FLASH_TP2_RANK
from omnistage.services.thinker.kernels import router
from omnistage.services.thinker.kernels.moe_one_token import one_token_experts
from omnistage.services.thinker.kernels.router import GemvTiles, normed_route

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the chain timer
from resident_gemv_gpu import time_chain  # noqa: E402

SWEEP = [GemvTiles(block_e, warps) for warps in (1, 2, 4, 8) for block_e in (1, 2, 4, 8, 16)]


def _weights(dims: dict, layers: int, dev: torch.device) -> list[dict]:
    e, h, i = dims["num_experts"], dims["hidden_size"], dims["moe_intermediate_size"]
    g = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16)

    return [
        dict(
            gate=rand(e, h),
            bias=torch.randn(e, generator=g, device=dev) * 0.01,
            norm=rand(h, scale=1.0),
            w13=rand(e, 2 * i, h),
            w2=rand(e, h, i),
            shared=(rand(2 * i, h), rand(h, i)),
        )
        for _ in range(layers)
    ]


def run(label: str, dims: dict, layers: int, dev: torch.device) -> dict:
    k, groups, top_groups = dims["num_experts_per_tok"], dims["n_group"], dims["topk_group"]
    weights = _weights(dims, layers, dev)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(1, dims["hidden_size"], generator=g, device=dev).to(torch.bfloat16)
    residual = torch.randn(1, dims["hidden_size"], generator=g, device=dev).to(torch.bfloat16)

    def routed(n: int):
        w = weights[n]
        return normed_route(x, residual, w["norm"], 1e-6, w["gate"], w["bias"], k, groups, top_groups, 2.5)

    def layer(n: int) -> torch.Tensor:
        rw, ids, normed, _ = routed(n)
        w = weights[n]
        return one_token_experts(normed, w["w13"], w["w2"], rw, ids, w["shared"])

    default = router.GEMV_TILES
    reference = routed(0)[:2]
    result: dict = {"shape": dict(dims), "default": vars(default), "tiles": {}}
    for tiles in SWEEP:
        router.GEMV_TILES = tiles
        key = f"{tiles.block_e}/{tiles.warps}"
        try:
            got = routed(0)[:2]
            row = {
                "router + experts us": round(time_chain(layer, layers), 2),
                "router us": round(time_chain(lambda n: routed(n)[0], layers), 2),
                "bits": all(torch.equal(a, b) for a, b in zip(got, reference, strict=True)),
            }
        except Exception as exc:  # a tiling that does not compile (registers)
            row = {"error": type(exc).__name__}
        finally:
            router.GEMV_TILES = default
        result["tiles"][key] = row
        print(f"[{label}] experts a program {tiles.block_e}, warps {tiles.warps}: {row}", flush=True)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6, help="layers a graph, each with its own weights")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    args = ap.parse_args()
    dev = torch.device("cuda")
    results = {
        "device": torch.cuda.get_device_name(dev),
        "ling-mini": run("ling-mini", LING_MINI, args.layers, dev),
        "ming-flash tp2 rank": run("ming-flash tp2", MING_FLASH_TP2_RANK, args.layers, dev),
    }
    if args.out:
        write_result(args.out, results, gpu=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
