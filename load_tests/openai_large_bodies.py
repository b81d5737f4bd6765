"""Many large bodies at once on the OpenAI front: are health and a small canary still answered? (issue 43)

    python load_tests/openai_large_bodies.py [--config deploy/local-tiny.yaml] [--bodies 60]
        [--ids 450000] [--out bench/load]

Starts `omnistage serve CONFIG` and, once it is ready, sends `--bodies` `POST /v1/completions` at once,
each a token-array prompt of `--ids` ids (450,000 three-digit ids: 1.8 MB, under the front's JSON-value
bound, so each is parsed whole). From another process (the burst's client must not delay it), every
0.25 s until the burst is answered: the gateway's gRPC Health/Check (what the launcher watches), the
front's GET /health and a canary chat request (one token). Reports the slowest of each (and of the
same probes for 8 s before the burst: what the machine gives them), the big requests' statuses and
whether the launcher restarted anything (its log). The target: every canary
< 3 s, no restart. Writes OUT/openai_large_bodies.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.runtime.deadlines import within

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_load import pipeline  # noqa: E402

PROBE_EVERY_S = 0.25
PROBE_TIMEOUT_S = 30.0
IDLE_S = 8.0
CANARY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}).encode()


async def post(port: int, path: str, body: bytes, timeout_s: float = 120.0) -> tuple[int, float]:
    """(HTTP status, seconds) of one POST over its own connection (0: no answer in time)."""
    start = time.monotonic()
    try:
        reader, writer = await within(asyncio.open_connection("127.0.0.1", port), timeout_s)
    except (OSError, TimeoutError):
        return 0, time.monotonic() - start
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    try:
        writer.write(head.encode() + body)
        await writer.drain()
        status_line = await within(reader.readline(), timeout_s)
        await within(reader.read(), timeout_s)
        status = int(status_line.split()[1]) if status_line else 0
    except (OSError, TimeoutError, ValueError, IndexError):
        status = 0
    finally:
        writer.close()
    return status, time.monotonic() - start


def _timed(call) -> float:
    start = time.monotonic()
    try:
        call()
    except (OSError, grpc.RpcError):
        return PROBE_TIMEOUT_S
    return time.monotonic() - start


def probe(grpc_address: str, http_port: int, stop, results) -> None:
    """In a process of its own (the burst's client must not delay it): every PROBE_EVERY_S the gateway's
    gRPC health (what the launcher watches), the front's GET /health and a canary chat request, until
    `stop`; their slowest answers into `results`."""
    base = f"http://127.0.0.1:{http_port}"
    canary = urllib.request.Request(
        base + "/v1/chat/completions", data=CANARY, headers={"Content-Type": "application/json"}
    )
    slowest = {"grpc_health_s": 0.0, "http_health_s": 0.0, "canary_s": 0.0}
    statuses: set[int] = set()
    with grpc.insecure_channel(grpc_address) as channel:
        health = health_pb2_grpc.HealthStub(channel)

        def ask_canary() -> None:
            try:
                with urllib.request.urlopen(canary, timeout=PROBE_TIMEOUT_S) as r:
                    statuses.add(r.status)
            except urllib.error.HTTPError as e:
                statuses.add(e.code)

        while not stop.is_set():
            for key, call in (
                (
                    "grpc_health_s",
                    lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S),
                ),
                (
                    "http_health_s",
                    lambda: urllib.request.urlopen(base + "/health", timeout=PROBE_TIMEOUT_S).read(),
                ),
                ("canary_s", ask_canary),
            ):
                slowest[key] = max(slowest[key], _timed(call))
            time.sleep(PROBE_EVERY_S)
    results.put({**{k: round(v, 3) for k, v in slowest.items()}, "canary_statuses": sorted(statuses)})


def probing(grpc_address: str, http_port: int):
    """A started prober process and its (stop, results)."""
    context = multiprocessing.get_context("spawn")
    stop, results = context.Event(), context.Queue()
    prober = context.Process(target=probe, args=(grpc_address, http_port, stop, results))
    prober.start()
    return prober, stop, results


def probed(prober, stop, results) -> dict:
    stop.set()
    out = results.get(timeout=2 * PROBE_TIMEOUT_S)
    prober.join(timeout=PROBE_TIMEOUT_S)
    return out


def burst(grpc_address: str, http_port: int, bodies: int, ids: int) -> dict:
    prompt = [100 + i % 900 for i in range(ids)]
    big = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}, separators=(",", ":")).encode()
    idle = probing(grpc_address, http_port)
    time.sleep(IDLE_S)  # the same probes with nothing else to do: what the machine gives them
    baseline = probed(*idle)
    during = probing(grpc_address, http_port)
    time.sleep(1.0)  # the prober is up

    async def send() -> list[tuple[int, float]]:
        return await asyncio.gather(*(post(http_port, "/v1/completions", big) for _ in range(bodies)))

    start = time.monotonic()
    answers = asyncio.run(send())
    burst_s = time.monotonic() - start
    time.sleep(1.0)
    statuses: dict[str, int] = {}
    for status, _ in answers:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    return {
        "bodies": bodies,
        "body_bytes": len(big),
        **probed(*during),
        "idle": baseline,
        "big_statuses": statuses,
        "burst_s": round(burst_s, 3),
        "slowest_big_s": round(max(s for _, s in answers), 3),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="deploy/local-tiny.yaml")
    p.add_argument("--bodies", type=int, default=60)
    p.add_argument("--ids", type=int, default=450_000)
    p.add_argument("--http-port", type=int, default=7153, help="the config's gateway.http_port")
    p.add_argument("--out", default="bench/load")
    args = p.parse_args(argv)
    out = Path(args.out)
    log = out / "openai_large_bodies.log"
    with pipeline(args.config, [], log) as address:
        result = burst(address, args.http_port, args.bodies, args.ids)
        time.sleep(2.0)  # a restart the burst caused shows in the log by now
    restarts = [line for line in log.read_text().splitlines() if "restart" in line.lower()]
    result["restarts"] = restarts
    result["met"] = result["canary_statuses"] == [200] and result["canary_s"] < 3.0 and not restarts
    (out / "openai_large_bodies.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
