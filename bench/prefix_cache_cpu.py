"""Prefix caching on the tiny checkpoint (CPU): TTFT cold vs warm, and a conversation's TTFT per turn.

1. A shared prefix of `--prefix-len` tokens (a long system prompt) with a new question each time:
   TTFT with the cache off (every request prefills the whole prompt) vs on (the prefix is cached).
2. A `--turns`-turn conversation as Converse sends it (each prompt = the previous prompt + the
   answer's ids + a new user turn): TTFT of each turn with the cache off and on.

One request at a time, engine only (no gRPC): TTFT = from add_request to the first token.

python bench/prefix_cache_cpu.py [--checkpoint DIR] [--prefix-len 4096] [--repeat 5] [--turns 10]

The machine may be shared: off and on are measured alternately and medians reported.
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
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank


def ttft(
    engine: LLMEngine, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, list[int], int, float]:
    """(seconds to the first token, the answer's ids, cached prompt tokens, CPU seconds of this process
    to the first token: less sensitive than wall time to other load on a shared machine) of one
    request alone."""
    start, cpu_start = time.perf_counter(), time.process_time()
    engine.add_prompt(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    first, cpu, ids, cached = None, 0.0, [], 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None:
                first, cpu = time.perf_counter() - start, time.process_time() - cpu_start
            ids += out.token_ids
            if out.finished:
                cached = out.usage.cached_prompt_tokens
    return first or 0.0, ids, cached, cpu


def words(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(0, 900) for _ in range(n)]


def shared_prefix(engines: dict[str, LLMEngine], prefix_len: int, repeat: int) -> None:
    rng = random.Random(0)
    prefix = words(rng, prefix_len)
    questions = [words(rng, 32) for _ in range(repeat + 1)]
    for name, engine in engines.items():
        ttft(engine, f"{name}-seed", prefix + questions[0], 4)  # computes the prefix once (cold for both)
    runs: dict[str, list] = {name: [] for name in engines}
    for i, q in enumerate(questions[1:]):  # off and on alternate: a noisy machine slows both alike
        for name, engine in engines.items():
            runs[name].append(ttft(engine, f"{name}-{i}", prefix + q, 4))
    print(
        f"\n1. shared prefix of {prefix_len} tokens + a new 32-token question, 4 output tokens (median of {repeat})"
    )
    print(f"{'cache':>6} {'TTFT ms':>9} {'CPU ms':>9} {'cached tokens':>14}")
    for name, r in runs.items():
        wall, cpu = (1000 * statistics.median(x[k] for x in r) for k in (0, 3))
        print(f"{name:>6} {wall:>9.1f} {cpu:>9.1f} {r[-1][2]:>14}")


def conversation(
    engines: dict[str, LLMEngine], turns: int, system_len: int, answer_len: int, repeat: int
) -> None:
    """`repeat` conversations (each new: turn 0 is cold for both); per turn, off and on alternate."""
    seconds = {name: [[] for _ in range(turns)] for name in engines}
    cpu = {name: [[] for _ in range(turns)] for name in engines}
    lengths, cached = [0] * turns, [0] * turns
    for r in range(repeat):
        rng = random.Random(100 + r)
        system = words(rng, system_len)
        users = [words(rng, 24) for _ in range(turns)]
        prompts = {name: list(system) for name in engines}
        for turn in range(turns):
            for name, engine in engines.items():
                prompt = prompts[name] + users[turn]
                t, answer, c, cpu_s = ttft(engine, f"{name}-{r}-{turn}", prompt, answer_len)
                seconds[name][turn].append(t)
                cpu[name][turn].append(cpu_s)
                lengths[turn] = len(prompt)
                if name == "on":
                    cached[turn] = c
                prompts[name] = prompt + answer
    print(
        f"\n2. {turns}-turn conversation: system {system_len} tokens, 24-token user turns, {answer_len}-token "
        f"answers (median of {repeat} conversations)"
    )
    print(
        f"{'turn':>4} {'prompt':>7} {'TTFT off ms':>12} {'TTFT on ms':>11} {'CPU off ms':>11} {'CPU on ms':>10} "
        f"{'cached':>7}"
    )
    for turn in range(turns):
        off, on = (1000 * statistics.median(seconds[n][turn]) for n in ("off", "on"))
        cpu_off, cpu_on = (1000 * statistics.median(cpu[n][turn]) for n in ("off", "on"))
        print(
            f"{turn:>4} {lengths[turn]:>7} {off:>12.1f} {on:>11.1f} {cpu_off:>11.1f} {cpu_on:>10.1f} "
            f"{cached[turn]:>7}"
        )


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
        cfg = EngineConfig(
            block_size=16, max_num_seqs=4, max_num_batched_tokens=8192, max_model_len=8192, prefix_caching=on
        )
        engines[name] = rank0_engine(start_rank(RankConfig(str(ckpt), cfg)))
    print(
        f"tiny checkpoint, CPU x{torch.get_num_threads()} threads, torch {torch.__version__}, block_size 16"
    )
    try:
        shared_prefix(engines, args.prefix_len, args.repeat)
        conversation(engines, args.turns, args.system_len, args.answer_len, args.repeat)
    finally:
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
