"""Prefix caching on the tiny checkpoint (CPU): TTFT cold vs warm, and a conversation's TTFT per turn.

1. A shared prefix of `--prefix-len` tokens (a long system prompt) with a new question each time:
   TTFT with the cache off (every request prefills the whole prompt) vs on (the prefix is cached).
2. A `--turns`-turn conversation as Converse sends it (each prompt = the previous prompt + the
   answer's ids + a new user turn): TTFT of each turn with the cache off and on.

One request at a time, engine only (no gRPC): TTFT = from add_request to the first token.

python bench/prefix_cache_cpu.py [--checkpoint DIR] [--prefix-len 4096] [--repeat 5] [--turns 10]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import torch
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint
from omnistage.common.config import EngineConfig
from omnistage.common.log import setup_logging
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine.startup import RankConfig, start_engine


def ttft(engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first token, the answer's ids, cached prompt tokens) of one request alone."""
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first, ids, cached = None, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None:
                first = time.perf_counter() - start
            ids += out.token_ids
            if out.finished:
                cached = out.usage.cached_prompt_tokens
    return first or 0.0, ids, cached


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 900) for _ in range(n)]


def shared_prefix(engines: dict[str, LLMEngine], prefix_len: int, repeat: int) -> None:
    rng = random.Random(0)
    prefix = words(rng, prefix_len)
    questions = [words(rng, 32) for _ in range(repeat + 1)]
    print(f"\n1. shared prefix of {prefix_len} tokens + a new 32-token question, 4 output tokens (median of {repeat})")
    print(f"{'cache':>6} {'TTFT ms':>9} {'cached tokens':>14}")
    for name, engine in engines.items():
        ttft(engine, f"{name}-seed", prefix + questions[0], 4)  # computes the prefix once (cold for both)
        runs = [ttft(engine, f"{name}-{i}", prefix + q, 4) for i, q in enumerate(questions[1:])]
        print(f"{name:>6} {1000 * statistics.median(r[0] for r in runs):>9.1f} {runs[-1][2]:>14}")


def conversation(engines: dict[str, LLMEngine], turns: int, system_len: int, answer_len: int) -> None:
    print(f"\n2. {turns}-turn conversation: system {system_len} tokens, 24-token user turns, {answer_len}-token answers")
    table = {}
    for name, engine in engines.items():
        rng = random.Random(1)
        prompt = words(rng, system_len)
        rows = []
        for turn in range(turns):
            prompt = prompt + words(rng, 24)
            seconds, answer, cached = ttft(engine, f"{name}-turn{turn}", prompt, answer_len)
            rows.append((seconds, len(prompt), cached))
            prompt = prompt + answer
        table[name] = rows
    print(f"{'turn':>4} {'prompt':>7} {'TTFT off ms':>12} {'TTFT on ms':>11} {'cached':>7}")
    for turn, (off, on) in enumerate(zip(table["off"], table["on"], strict=True)):
        print(f"{turn:>4} {off[1]:>7} {1000 * off[0]:>12.1f} {1000 * on[0]:>11.1f} {on[2]:>7}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--checkpoint", default="")
    ap.add_argument("--prefix-len", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--answer-len", type=int, default=48)
    args = ap.parse_args()
    setup_logging("bench", level="warning")
    ckpt = args.checkpoint or write_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-ming-"))
    engines = {}
    for name, on in (("off", False), ("on", True)):
        cfg = EngineConfig(block_size=16, max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=8192,
                           prefix_caching=on)  # fmt: skip
        engines[name] = start_engine(RankConfig(str(ckpt), cfg))
    print(f"tiny checkpoint, CPU x{torch.get_num_threads()} threads, torch {torch.__version__}, block_size 16")
    try:
        shared_prefix(engines, args.prefix_len, args.repeat)
        conversation(engines, args.turns, args.system_len, args.answer_len)
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
