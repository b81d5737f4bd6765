"""Many large gRPC requests at once at a gateway's runtime: is its health ever starved? (issue 43)

    python load_tests/large_requests.py [--requests 120] [--records 99999] [--out bench/load]

A gateway ServiceRuntime (the real CallGuard and the gateway's wire bounds; a servicer that answers
at once, so only arrival is measured) takes `--requests` requests of `--records` protobuf records
each (`dense`: a GenerateRequest whose request_id is repeated, every record walked in Python;
`packed`: prompt_token_ids, walked at C speed; none past the wire bounds),
all at once, while a health Check goes out every 20 ms. Reports one walk's time, how the requests
ended (OK, or RESOURCE_EXHAUSTED with its retry hint), when the last ended, and the slowest health
answer during the flood: the launcher takes a process for hung when health goes unanswered past
supervision.heartbeat_timeout_s (10 s). Writes OUT/large_requests_KIND.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.services.gateway.validation import RequestLimits, wire_bounds
from omnistage.v1 import omni_pb2, omni_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]
GENERATE = "/omnistage.v1.Omni/Generate"


class Answering(omni_pb2_grpc.OmniServicer):
    async def Generate(self, request, context):
        yield omni_pb2.GenerateEvent(request_id="ok")


async def probe(channel: grpc.aio.Channel, stop: asyncio.Event, latencies: list[float]) -> None:
    stub = health_pb2_grpc.HealthStub(channel)
    while not stop.is_set():
        sent = time.monotonic()
        try:
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
        except grpc.aio.AioRpcError:
            pass
        latencies.append(time.monotonic() - sent)
        await asyncio.sleep(0.02)


async def one(channel: grpc.aio.Channel, data: bytes, t0: float) -> dict:
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)
    try:
        [e async for e in call(data, timeout=120)]
        return {"code": "OK", "end_s": time.monotonic() - t0}
    except grpc.aio.AioRpcError as exc:
        hint = dict(exc.trailing_metadata() or ()).get("grpc-retry-pushback-ms")
        return {"code": exc.code().name, "retry_ms": hint, "end_s": time.monotonic() - t0}


def request_bytes(kind: str, records: int) -> bytes:
    """`dense`: request_id repeated (each record walked in Python); `packed`: prompt_token_ids, one
    packed run of `records` ids (counted at C speed)."""
    if kind == "dense":
        return b"\x0a\x00" * records
    return omni_pb2.GenerateRequest(
        prompt_token_ids=[1000 + i % 50_000 for i in range(records)]
    ).SerializeToString()


async def flood(n: int, records: int, kind: str) -> dict:
    data = request_bytes(kind, records)
    bounds = wire_bounds(RequestLimits())["Generate"]
    started = time.monotonic()
    assert bounds.refusal(data) == ""
    walk_s = time.monotonic() - started
    cfg = config_from_dict({"services": {"gw": {"kind": "gateway", "port": 1}}})
    with tempfile.TemporaryDirectory() as tmp:
        rt = ServiceRuntime(cfg, cfg.service("gw"), 0, run_dir=Path(tmp), port=0, metrics_port=0)
        await rt.start()
        try:
            rt.add_servicer(
                omni_pb2_grpc.add_OmniServicer_to_server,
                Answering(),
                "omnistage.v1.Omni",
                bounds=wire_bounds(RequestLimits()),
            )
            rt.set_serving()
            async with (
                grpc.aio.insecure_channel(rt.address) as ch,
                grpc.aio.insecure_channel(rt.address) as health,
            ):
                stop, latencies = asyncio.Event(), []
                prober = asyncio.ensure_future(probe(health, stop, latencies))
                await asyncio.sleep(0.2)
                t0 = time.monotonic()
                ends = await asyncio.gather(*(one(ch, data, t0) for _ in range(n)))
                stop.set()
                await prober
        finally:
            rt.request_stop()
            await rt.serve_until_stopped()
    codes: dict[str, int] = {}
    for e in ends:
        codes[e["code"]] = codes.get(e["code"], 0) + 1
    hints = sorted(int(e["retry_ms"]) for e in ends if e.get("retry_ms"))
    return {
        "requests": n,
        "kind": kind,
        "records": records,
        "bytes": len(data),
        "one_walk_s": round(walk_s, 4),
        "codes": codes,
        "retry_hint_ms": [hints[0], hints[-1]] if hints else None,
        "last_end_s": round(max(e["end_s"] for e in ends), 2),
        "health_max_s": round(max(latencies), 3),
        "health_probes": len(latencies),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=120)
    ap.add_argument("--records", type=int, default=99_999)
    ap.add_argument("--kind", choices=("dense", "packed"), default="dense")
    ap.add_argument("--out", default=str(ROOT / "bench" / "load"))
    args = ap.parse_args(argv)
    result = asyncio.run(flood(args.requests, args.records, args.kind))
    print(json.dumps(result, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"large_requests_{args.kind}.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
