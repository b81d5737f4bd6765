"""Thinker engine throughput on the tiny checkpoint (CPU) by concurrency; prints a table.

python bench/thinker_cpu.py [--checkpoint DIR] [--tp N] [--prompt-len 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint
from omnistage.common.config import EngineConfig
from omnistage.common.log import setup_logging
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tests/…/local_ranks.py)
from tests.services.thinker.group import local_ranks  # noqa: E402


def run(engine: LLMEngine, concurrency: int, prompt_len: int, max_tokens: int) -> dict[str, float]:
    rng = random.Random(concurrency)
    prompts = [[rng.randrange(0, 900) for _ in range(prompt_len)] for _ in range(concurrency)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    steps0 = engine.num_steps
    start = time.perf_counter()
    results = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    out_tokens = sum(len(r.token_ids) for r in results)
    return {
        "concurrency": concurrency,
        "seconds": elapsed,
        "out_tok_s": out_tokens / elapsed,
        "total_tok_s": (out_tokens + prompt_len * concurrency) / elapsed,
        "steps": engine.num_steps - steps0,
        "ms_per_step": 1000 * elapsed / max(1, engine.num_steps - steps0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--concurrency", default="1,4,16,32")
    args = ap.parse_args()
    setup_logging("bench", level="warning")
    ckpt = args.checkpoint or write_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-ming-"))
    cfg = EngineConfig(block_size=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024)
    rank_cfg = RankConfig(str(ckpt), cfg, world_size=args.tp, dist_port=local_ranks.free_port())
    procs = local_ranks.spawn_workers(rank_cfg) if args.tp > 1 else []
    engine = rank0_engine(start_rank(rank_cfg))
    try:
        run(engine, 2, 8, 4)  # warm-up
        print(
            f"thinker engine, tiny checkpoint, CPU x{torch.get_num_threads()} threads, TP={args.tp}, "
            f"prompt {args.prompt_len} tokens, {args.max_tokens} output tokens/request"
        )
        print(
            f"{'concurrency':>11} {'seconds':>8} {'out tok/s':>10} {'total tok/s':>12} {'steps':>6} {'ms/step':>8}"
        )
        for c in (int(x) for x in args.concurrency.split(",")):
            r = run(engine, c, args.prompt_len, args.max_tokens)
            print(
                f"{c:>11} {r['seconds']:>8.2f} {r['out_tok_s']:>10.1f} {r['total_tok_s']:>12.1f} "
                f"{r['steps']:>6} {r['ms_per_step']:>8.1f}"
            )
    finally:
        engine.shutdown()
        local_ranks.join_workers(procs, 60)


if __name__ == "__main__":
    main()
