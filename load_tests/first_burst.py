"""The first burst after start-up: does admission let in only what it can finish in time? (issue 30)

    python load_tests/first_burst.py [--config deploy/local-tiny.yaml] [--requests 300]
        [--max-tokens 256] [--deadline-s 15,30] [--kinds text] [--bursts 2] [--out bench/load]

Starts `omnistage serve CONFIG` and, as soon as it is ready (no warm-up request of ours), sends
`--requests` requests at once, each with its own deadline drawn from the `--deadline-s` range (its gRPC
timeout and its goodput deadline alike); then, `--bursts` > 1, the same again once the first has ended.
Per burst: admitted (everything not refused with RESOURCE_EXHAUSTED), of those finished in time (OK
within their deadline), the share, and the refusals' statuses. The promise: >= 90 % of the admitted
finish in time, from the first burst on. Writes OUT/first_burst.json. `--kinds text,speech,image`
cycles through those kinds (speech and image need their stages).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from dataclasses import replace
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from omnistage.common.load_driver import RequestShape, one_request  # noqa: E402
from omnistage.v1 import omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402


async def burst(address: str, n: int, kinds: list[str], shape: RequestShape, lo: float, hi: float, seed: int):
    rng = random.Random(seed)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        calls = []
        for i in range(n):
            deadline = rng.uniform(lo, hi)
            kind = kinds[i % len(kinds)]
            calls.append(one_request(stub, kind, i, replace(shape, deadline_s=deadline, timeout_s=deadline)))
        records = await asyncio.gather(*calls)
    admitted = [r for r in records if r.code != "RESOURCE_EXHAUSTED"]
    in_time = [r for r in admitted if r.good]
    refused: dict[str, int] = {}
    for r in records:
        if not r.good:
            refused[r.code] = refused.get(r.code, 0) + 1
    return {
        "requests": n,
        "admitted": len(admitted),
        "in_time": len(in_time),
        "share_in_time": round(len(in_time) / len(admitted), 3) if admitted else None,
        "not_good_by_status": refused,
        "by_kind": {
            k: {"admitted": sum(r.kind == k for r in admitted), "in_time": sum(r.kind == k for r in in_time)}
            for k in kinds
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="deploy/local-tiny.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--deadline-s", default="15,30", help="low,high of the deadlines drawn per request")
    ap.add_argument("--kinds", default="text", type=lambda s: [k for k in s.split(",") if k])
    ap.add_argument("--bursts", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/load")
    args = ap.parse_args()
    lo, hi = (float(x) for x in args.deadline_s.split(","))
    shape = RequestShape(max_tokens=args.max_tokens, image_size=256, image_steps=4, input_image_px=128)
    out = Path(args.out)
    results = []
    with pipeline(args.config, args.overrides, out / "first_burst.serve.log") as address:
        for b in range(args.bursts):
            row = asyncio.run(burst(address, args.requests, args.kinds, shape, lo, hi, args.seed + b))
            results.append(row)
            print(f"burst {b + 1}: {json.dumps(row)}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "first_burst.json").write_text(
        json.dumps({"config": args.config, "bursts": results}, indent=1) + "\n"
    )
    first = results[0]["share_in_time"]
    return 0 if first is None or first >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
