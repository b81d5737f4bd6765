"""Slow constraints beside a canary: does a JSON schema slow to compile stall anyone else? (issue 43)

    python load_tests/grammar_stall.py [--config deploy/local-tiny.yaml] [--rounds 2] [--out bench/load]

Starts the thinker and the gateway of CONFIG (`omnistage serve`, free ports; the other stages are left
out: text only) and, per scenario, sends two constrained requests at once, then, 0.2 s later, a plain
canary request; it records when each constrained request was answered or refused (its status and
message) and the canary's first token. Scenarios: `valid` (a small schema: the deployment's first
structured requests, answered), `deep` (two schemas nested 450 deep, 28 KB: the
issue's probe), `slow` (two one-level schemas whose `pattern` takes ~30 s to compile on the tiny
vocabulary: only the compile's time bound stops them), and over HTTP `deep-http` (the same schema as
a chat `response_format`). The targets: each constrained request answered or refused within 10 s,
the canary's first token within 3 s. Writes OUT/grammar_stall.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from chaos_launch import free_ports  # noqa: E402
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SLOW_PATTERN = "^(ab|cd|ef){1,3000}$"  # 29 s to compile on the tiny vocabulary, one level deep
# A schema as clients send them: the deployment's first structured requests (then cached).
VALID = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
}


def nested(depth: int) -> str:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return json.dumps(schema)


def text_only(config: str, tmp: Path) -> tuple[Path, str]:
    """CONFIG with only its thinker and gateway, on free ports: (the file, the HTTP front's address)."""
    cfg = yaml.safe_load(Path(config).read_text())
    services = {k: v for k, v in cfg["services"].items() if v["kind"] in ("thinker", "gateway")}
    for svc in services.values():
        svc["port"], svc["admin_port"], svc["metrics_port"] = free_ports(3)
        if svc["kind"] == "thinker":
            svc["dist_port"] = free_ports(1)[0]
    (gateway,) = (s for s in services.values() if s["kind"] == "gateway")
    gateway.setdefault("gateway", {})["http_port"] = free_ports(1)[0]
    cfg["services"] = services
    cfg["model"]["checkpoint"] = str((ROOT / cfg["model"]["checkpoint"]).resolve())
    path = tmp / "grammar-stall.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, f"{cfg.get('host', '127.0.0.1')}:{gateway['gateway']['http_port']}"


def request(request_id: str, schema: str | None) -> omni_pb2.GenerateRequest:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Answer in JSON.")])
    sampling = common_pb2.SamplingParams(max_tokens=16)
    if schema is not None:
        sampling.constraint.json_schema = schema
    return omni_pb2.GenerateRequest(request_id=request_id, messages=[msg], sampling=sampling)


async def grpc_call(stub, req: omni_pb2.GenerateRequest, t0: float) -> dict:
    """When it was answered (its first text) or refused, and how."""
    first = None
    try:
        async for event in stub.Generate(req, timeout=300):
            if event.WhichOneof("event") == "text" and first is None:
                first = time.monotonic() - t0
        return {"id": req.request_id, "code": "OK", "first_token_s": first, "end_s": time.monotonic() - t0}
    except grpc.aio.AioRpcError as exc:
        return {
            "id": req.request_id,
            "code": exc.code().name,
            "message": exc.details()[:200],
            "end_s": time.monotonic() - t0,
        }


def http_call(http: str, schema: str, t0: float) -> dict:
    body = {
        "model": "ming",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "max_tokens": 16,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "deep", "schema": json.loads(schema)},
        },
    }
    req = urllib.request.Request(
        f"http://{http}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as reply:
            return {"code": reply.status, "end_s": time.monotonic() - t0}
    except urllib.error.HTTPError as exc:
        return {"code": exc.code, "message": exc.read().decode()[:300], "end_s": time.monotonic() - t0}


async def scenario(address: str, http: str, name: str, schema: str) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        t0 = time.monotonic()
        if name.endswith("-http"):
            loop = asyncio.get_running_loop()
            slow = [loop.run_in_executor(None, http_call, http, schema, t0) for _ in range(2)]
        else:
            slow = [
                asyncio.ensure_future(grpc_call(stub, request(f"{name}-{i}", schema), t0)) for i in range(2)
            ]
        await asyncio.sleep(0.2)
        canary = await grpc_call(stub, request(f"{name}-canary", None), t0)
        constrained = await asyncio.gather(*slow)
    return {"scenario": name, "constrained": constrained, "canary": canary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "deploy" / "local-tiny.yaml"))
    ap.add_argument("--depth", type=int, default=450)
    ap.add_argument(
        "--rounds", type=int, default=2, help="each scenario this many times (the second: cached)"
    )
    ap.add_argument("--out", default=str(ROOT / "bench" / "load"))
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    out = Path(args.out)
    schemas = {
        "valid": json.dumps(VALID),
        "deep": nested(args.depth),
        "slow": json.dumps({"type": "string", "pattern": SLOW_PATTERN}),
        "deep-http": nested(args.depth),
    }
    results = []
    with tempfile.TemporaryDirectory(prefix="grammar-stall-") as tmp:
        config, http = text_only(args.config, Path(tmp))
        with pipeline(str(config), args.overrides, out / "grammar_stall.serve.log") as address:
            for round_ in range(args.rounds):
                for name, schema in schemas.items():
                    row = asyncio.run(scenario(address, http, name, schema))
                    row["round"] = round_ + 1
                    results.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| scenario | round | constrained: status, answered/refused after | canary first token |")
    print("|---|---|---|---|")
    for r in results:
        answered = "; ".join(f"{c['code']} {c['end_s']:.2f} s" for c in r["constrained"])
        first = r["canary"].get("first_token_s")
        canary = f"{first:.2f} s" if first is not None else r["canary"]["code"]
        print(f"| {r['scenario']} | {r['round']} | {answered} | {canary} |")
    out.mkdir(parents=True, exist_ok=True)
    (out / "grammar_stall.json").write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
