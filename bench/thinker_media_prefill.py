"""The thinker's prefill time for an image prompt (a 1024² image = 1024 thinker tokens), on a GPU.

    source bench/device_env.sh
    python3 bench/thinker_media_prefill.py --shape ming-flash --tp 2     # GPUs 0..1, dummy bf16 weights
    python3 bench/thinker_media_prefill.py --shape tiny --device cpu     # smoke run

Rank 0's engine in this process (ranks 1.. spawned, `local_ranks`), weights made on the device
(`load_format: dummy`, a config-only checkpoint of the shape). The image rows come the service's way:
random L2-normalised [1024, hidden] rows put in a producer's shm pool, taken by `MediaInputs`
(layout checks, copy out of shm, router codes, 3D positions), then one prefill step + one token.
Against a text prompt of the same length. Median of --repeat runs, after a warm-up of each shape.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.config_only import write_config_checkpoint
from omnistage.common.config import EngineConfig
from omnistage.common.log import setup_logging
from omnistage.common.transport import TransportContext, TransportOptions, encode
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.v1 import encoder_pb2, thinker_pb2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tests/…/local_ranks.py)
from tests.services.thinker.group import local_ranks  # noqa: E402


def image_prompt(cfg: ThinkerConfig, side: int, before: int = 30, after: int = 10) -> list[int]:
    """Text ids, then `<image>` + side·side `<imagePatch>` + `</image>`, then text ids."""
    return (
        [i % 900 for i in range(before)]
        + [cfg.image_start_token_id]
        + [cfg.image_patch_token_id] * side * side
        + [cfg.image_end_token_id]
        + [i % 900 for i in range(after)]
    )


def timed_ms(engine, prompt, device: str, repeat: int) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(repeat):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate([prompt], params)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="ming-flash", choices=("ming-flash", "ling-mini", "tiny"))
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--sides", default="16,32", help="merged grid sides (32: a 1024x1024 image, 1024 tokens)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    setup_logging("bench", level="warning")
    ckpt = write_config_checkpoint(Path(tempfile.mkdtemp(prefix="media-prefill-")) / "ckpt", args.shape)
    cfg = ThinkerConfig.from_checkpoint(ckpt)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    engine_cfg = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=2048, max_model_len=4096)
    rank_cfg = RankConfig(
        str(ckpt),
        engine_cfg,
        load_format="dummy",
        dtype=dtype,
        device="cpu" if args.device == "cpu" else "cuda:0",
        world_size=args.tp,
        dist_port=local_ranks.free_port(),
    )
    procs = local_ranks.spawn_workers(rank_cfg) if args.tp > 1 else []
    engine = rank0_engine(start_rank(rank_cfg))
    rows_dtype = getattr(torch, dtype)
    results = []
    try:
        with TransportContext(TransportOptions(shm_pool_bytes=256 << 20)) as producer:
            inputs = MediaInputs(cfg, rows_dtype, TransportContext())
            for side in (int(s) for s in args.sides.split(",")):
                ids = image_prompt(cfg, side)
                rows = torch.nn.functional.normalize(torch.randn(side * side, cfg.hidden_size), dim=-1).to(
                    rows_dtype
                )

                def image_request(ids=ids, rows=rows, side=side):
                    item = thinker_pb2.MultimodalEmbedding(
                        placeholder_token_id=cfg.image_patch_token_id,
                        embeddings=encode(rows, transport=producer, force="shm"),
                        merged_grids=[encoder_pb2.GridTHW(t=1, h=side, w=side)],
                    )
                    return inputs.build(ids, [item])

                text = [i % 900 for i in range(len(ids))]
                started = time.perf_counter()
                prompt = image_request()
                build = 1000 * (time.perf_counter() - started)
                timed_ms(engine, text, args.device, 1)  # warm-up of the shape
                timed_ms(engine, prompt, args.device, 1)
                image_ms = timed_ms(engine, prompt, args.device, args.repeat)
                text_ms = timed_ms(engine, text, args.device, args.repeat)
                results.append(
                    {
                        "image_side_px": side * 32,
                        "tokens": len(ids),
                        "image_rows": side * side,
                        "take_request_ms": round(build, 2),
                        "image_prefill_ms": round(image_ms, 1),
                        "text_prefill_ms": round(text_ms, 1),
                    }
                )
            inputs.close()
    finally:
        engine.shutdown()
        local_ranks.join_workers(procs, 120)
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"thinker prefill, shape {args.shape}, TP={args.tp}, {device}, {dtype}, torch {torch.__version__}")
    print(
        "| image | prompt tokens | taking the request ms | image prompt prefill ms | text prompt, same length ms |"
    )
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['image_side_px']}² ({r['image_rows']} rows) | {r['tokens']} | {r['take_request_ms']} | "
            f"{r['image_prefill_ms']} | {r['text_prefill_ms']} |"
        )
    if os.environ.get("OUT"):
        write_result(
            Path(os.environ["OUT"], "thinker_media_prefill.json"),
            {"device": device, "shape": args.shape, "tp": args.tp, "rows": results},
            gpu=args.device == "cuda" and args.shape != "tiny",
            indent=2,
        )


if __name__ == "__main__":
    main()
