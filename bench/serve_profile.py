"""Where the host time goes between the gateway and the engine under spoken load (issues 38, 39).

    python bench/serve_profile.py [--config deploy/h200x2.yaml] [--concurrency 64] [--seconds 30]

Starts `omnistage serve` (config-only checkpoint, `load_format: dummy`; --tiny: the CPU tiny
pipeline), keeps `--concurrency` spoken answers in flight (gRPC, greedy, `ignore_eos`, 64 new tokens)
and, meanwhile, samples the gateway, thinker rank 0 and talker processes with py-spy (`pip install
py-spy`; on the device its carried wheel, bench/serve_profile.sh). Writes OUT/serve_profile.json:
{"device", "date", "command", "concurrency", "requests", "ttft_p50_ms", "processes": {name: {"samples",
"active_share", "threads", "self": [[frame, share]], "inclusive": [[frame, share]]}}} and each
process's raw stacks (OUT/serve_profile.<name>.txt: py-spy's collapsed format).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "load_tests"))
sys.path.insert(0, str(ROOT / "bench"))

from omnistage.common.bench_results import write_result  # noqa: E402
from omnistage.common.checkpoint.config_only import write_config_checkpoint  # noqa: E402
from omnistage.common.load_stats import percentile  # noqa: E402
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc  # noqa: E402
from pipeline_load import pipeline  # noqa: E402
from pipeline_real_size import device_name  # noqa: E402

PROCESSES = ("gateway", "thinker", "talker")  # rank 0 of each
RATE_HZ = 100
TOP = 40


def spoken(i: int) -> omni_pb2.GenerateRequest:
    return omni_pb2.GenerateRequest(
        request_id=f"profile-{i}",
        messages=[
            omni_pb2.ChatMessage(
                role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Tell me a story.")]
            )
        ],
        output_modalities=[omni_pb2.MODALITY_TEXT, omni_pb2.MODALITY_AUDIO],
        sampling=common_pb2.SamplingParams(max_tokens=64, ignore_eos=True, temperature=0.0),
    )


async def drive(address: str, concurrency: int, seconds: float) -> list[float]:
    """Closed loop of `concurrency` spoken answers for `seconds`; each answer's time to first text."""
    ttfts: list[float] = []
    until = time.monotonic() + seconds
    async with grpc.aio.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)

        async def loop(worker: int) -> None:
            n = 0
            while time.monotonic() < until:
                started, first = time.monotonic(), None
                async for event in stub.Generate(spoken(worker * 10_000 + n), timeout=300):
                    if first is None and event.WhichOneof("event") == "text":
                        first = time.monotonic() - started
                        ttfts.append(first)
                n += 1

        await asyncio.gather(*(loop(w) for w in range(concurrency)))
    return ttfts


def summarize(raw: Path, wall_samples: int) -> dict:
    """Self and inclusive shares of the frames in py-spy's collapsed stacks (active samples only)."""
    total, own, incl, threads = 0, collections.Counter(), collections.Counter(), collections.Counter()
    for line in raw.read_text().splitlines():
        if not line.strip():
            continue
        stack, count = line.rsplit(" ", 1)
        n, frames = int(count), stack.split(";")
        total += n
        threads[frames[0]] += n
        own[frames[-1]] += n
        for frame in set(frames):
            incl[frame] += n

    def shares(counter: collections.Counter) -> list[list]:
        return [[frame, round(c / max(total, 1), 4)] for frame, c in counter.most_common(TOP)]

    return {
        "samples": total,
        "active_share": round(total / max(wall_samples, 1), 3),  # of one core
        "threads": shares(threads)[:8],
        "self": shares(own),
        "inclusive": shares(incl),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--config", default="", help="deploy file (default deploy/h200x2.yaml; --tiny: local-tiny)"
    )
    ap.add_argument("--tiny", action="store_true", help="the CPU tiny pipeline (how this script is checked)")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds sampled (the load runs 10 s longer)")
    ap.add_argument("--checkpoint", default="", help="config-only checkpoint folder (default: a temp dir)")
    ap.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "bench" / "results"))
    ap.add_argument("--command", default="", help="the command line to record")
    args = ap.parse_args()
    config = args.config or str(ROOT / "deploy" / ("local-tiny.yaml" if args.tiny else "h200x2.yaml"))
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpu = not device_name().startswith("cpu") and not args.tiny
    data: dict = {
        "device": device_name(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": args.command or " ".join(["bench/serve_profile.py", *sys.argv[1:]]),
        "config": os.path.relpath(config, ROOT),
        "concurrency": args.concurrency,
        "processes": {},
    }
    with tempfile.TemporaryDirectory(prefix="serve-profile-") as tmp:
        overrides = []
        if not args.tiny:
            ckpt = Path(args.checkpoint or Path(tmp) / "ckpt")
            if not (ckpt / "config.json").is_file():
                write_config_checkpoint(ckpt, "ming-flash")
            overrides = [f"model.checkpoint={ckpt}", "model.load_format=dummy"]
        log = out / "serve_profile.serve.log"
        with pipeline(config, overrides, log) as address:
            pids = dict(re.findall(r"omnistage: started (\w+) r0 \(pid (\d+)\)", log.read_text()))
            spies = {
                name: subprocess.Popen(
                    [spy, "record", "-p", pids[name], "-d", str(int(args.seconds)), "-r", str(RATE_HZ)]
                    + ["--format", "raw", "--nonblocking", "-o", str(out / f"serve_profile.{name}.txt")],
                    stdout=subprocess.DEVNULL,
                    stderr=open(out / f"serve_profile.{name}.err", "w"),  # noqa: SIM115 - the child's
                )
                for name in PROCESSES
                if name in pids
            }
            ttfts = asyncio.run(drive(address, args.concurrency, args.seconds + 10))
            for proc in spies.values():
                proc.wait(timeout=60)
    data["requests"] = len(ttfts)
    data["ttft_p50_ms"] = round(1000 * percentile(ttfts, 50), 1) if ttfts else None
    for name in spies:
        raw = out / f"serve_profile.{name}.txt"
        if raw.is_file():
            data["processes"][name] = summarize(raw, int(args.seconds * RATE_HZ))
            print(
                name, {k: v for k, v in data["processes"][name].items() if k in ("samples", "active_share")}
            )
    write_result(out / "serve_profile.json", data, gpu=gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
