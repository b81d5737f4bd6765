"""What a multimodal prompt costs the thinker on CPU; prints two tables.

1. Taking the request (`MediaInputs.build`: layout checks, copy of the rows out of a producer's shm
   slice, router codes, 3D positions) for one image of N rows, at the tiny hidden size and at Ming's
   (4096, bfloat16).
2. Prefill (one step, TP=1, tiny checkpoint) of an image prompt against a text prompt of the same
   length: the splice and the per-modality routers against plain text.

python bench/multimodal_cpu.py [--checkpoint DIR] [--repeat 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time

import torch
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint
from omnistage.common.config import EngineConfig
from omnistage.common.log import setup_logging
from omnistage.common.transport import TransportContext, TransportOptions, encode
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.v1 import encoder_pb2, thinker_pb2


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def image_prompt(cfg: ThinkerConfig, side: int, before: int = 30, after: int = 10) -> list[int]:
    """Text ids, then `<image>` + side·side `<imagePatch>` + `</image>`, then text ids."""
    return (
        [i % 900 for i in range(before)]
        + [cfg.image_start_token_id]
        + [cfg.image_patch_token_id] * side * side
        + [cfg.image_end_token_id]
        + [i % 900 for i in range(after)]
    )


def image_item(cfg: ThinkerConfig, data: torch.Tensor, side: int, producer: TransportContext | None):
    return thinker_pb2.MultimodalEmbedding(
        placeholder_token_id=cfg.image_patch_token_id,
        embeddings=encode(data, transport=producer, force="shm" if producer else None),
        merged_grids=[encoder_pb2.GridTHW(t=1, h=side, w=side)],
    )


def build_cost(cfg: ThinkerConfig, dtype: torch.dtype, side: int, repeat: int) -> tuple[int, float, float]:
    """(rows, MiB, median ms) of taking a request with one side x side merged-grid image from shm."""
    rows = side * side
    ids = image_prompt(cfg, side)
    data = torch.randn(rows, cfg.hidden_size).to(dtype)
    with TransportContext(TransportOptions(shm_pool_bytes=64 << 20)) as producer:
        inputs = MediaInputs(cfg, dtype, TransportContext())

        def once() -> None:
            inputs.build(ids, [image_item(cfg, data, side, producer)])

        ms = median_ms(once, repeat)  # includes the producer's own copy into shm (encode)
        enc = median_ms(lambda: producer.release(encode(data, transport=producer, force="shm")), repeat)
        inputs.close()
    return rows, data.numel() * data.element_size() / 2**20, ms - enc


def prefill_ms(engine, prompt, repeat: int) -> float:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    return median_ms(lambda: engine.generate([prompt], params), repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    setup_logging("bench", level="warning")
    ckpt = args.checkpoint or write_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-ming-"))
    tiny = ThinkerConfig.from_checkpoint(ckpt)
    ming = dataclasses.replace(tiny, hidden_size=4096)
    print(
        f"1. taking a request with one image (MediaInputs.build, rows from shm), CPU x{torch.get_num_threads()}"
    )
    print(f"{'hidden':>7} {'dtype':>9} {'rows':>6} {'MiB':>7} {'ms':>8}")
    for cfg, dtype in ((tiny, torch.float32), (ming, torch.bfloat16)):
        for side in (16, 32):
            rows, mib, ms = build_cost(cfg, dtype, side, args.repeat)
            print(
                f"{cfg.hidden_size:>7} {str(dtype).removeprefix('torch.'):>9} {rows:>6} {mib:>7.2f} {ms:>8.2f}"
            )

    engine = rank0_engine(
        start_rank(
            RankConfig(
                str(ckpt),
                EngineConfig(block_size=16, max_num_batched_tokens=2048, max_model_len=2048, max_num_seqs=4),
            )
        )
    )
    inputs = MediaInputs(tiny, torch.float32, TransportContext())
    print("2. prefill of one prompt (tiny checkpoint, TP=1, one step + 1 token), median ms")
    print(f"{'prompt':>28} {'tokens':>7} {'ms':>8}")
    for side in (8, 16, 32):
        ids = image_prompt(tiny, side)
        rows = torch.nn.functional.normalize(torch.randn(side * side, tiny.hidden_size), dim=-1)
        prompt = inputs.build(ids, [image_item(tiny, rows, side, None)])
        text = [i % 900 for i in range(len(ids))]
        prefill_ms(engine, text, 2)  # warm-up of this shape
        print(
            f"{f'text + {side}x{side} image':>28} {len(ids):>7} {prefill_ms(engine, prompt, args.repeat):>8.2f}"
        )
        print(f"{'text only, same length':>28} {len(ids):>7} {prefill_ms(engine, text, args.repeat):>8.2f}")
    engine.shutdown()


if __name__ == "__main__":
    main()
