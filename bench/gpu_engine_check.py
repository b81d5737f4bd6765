"""The thinker engine on CUDA vs the CPU path: greedy tokens at TP=1 and TP=2, plus a smoke throughput.

python bench/gpu_engine_check.py [--tp 1,2] [--prompts 8] [--max-tokens 32]

For each dtype (fp32, bf16) and TP size it runs the same prompts greedily and compares with the
CPU fp32 engine: identical tokens are expected in fp32; in bf16 the first-step logits are compared
by relative error and tokens are compared up to the first divergence (bf16 rounding may flip a
near-tie of the random tiny model). Prints a markdown table last.
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
from omnistage.services.thinker.engine.step_plan import build_step_plan
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (tests/…/local_ranks.py)
from tests.services.thinker.group import local_ranks  # noqa: E402

CFG = EngineConfig(block_size=16, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=1024)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, vocab) for _ in range(rng.randrange(5, 120))] for _ in range(n)]


def _first_logits(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Logits of the prompt's last position (one prefill step), on the CPU in fp32."""
    engine.add_prompt("logits-probe", prompt, SamplingParams(max_tokens=1))
    batch = engine.scheduler.schedule()
    plan = engine.control.broadcast_plan(build_step_plan(batch.scheduled, engine.cfg.block_size))
    logits = engine.runner.execute(plan)
    engine.abort("logits-probe")
    return logits[-1].float().cpu()


def _run(ckpt, device: str, dtype: str, tp: int, prompts, max_tokens: int):
    dev0 = "cpu" if device == "cpu" else "cuda:0"
    cfg = RankConfig(
        str(ckpt), CFG, dtype=dtype, device=dev0, world_size=tp, dist_port=local_ranks.free_port()
    )
    procs = local_ranks.spawn_workers(cfg) if tp > 1 else []
    engine = rank0_engine(start_rank(cfg))
    try:
        logits = _first_logits(engine, prompts[0])
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        tokens = [r.token_ids for r in engine.generate(prompts, params)]
        speed = {}
        if device != "cpu":
            for c in (1, 8, 32):
                batch = [prompts[i % len(prompts)] for i in range(c)]
                engine.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True))  # warm
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                res = engine.generate(batch, SamplingParams(max_tokens=64, ignore_eos=True))
                torch.cuda.synchronize()
                speed[c] = sum(len(r.token_ids) for r in res) / (time.perf_counter() - t0)
        return logits, tokens, speed
    finally:
        engine.shutdown()
        local_ranks.join_workers(procs, 120)


def agreed_steps(a: list[int], b: list[int]) -> int:
    """Steps two greedy token lists agree on, up to their first divergence."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    setup_logging("gpu-check", level="warning")
    ckpt = write_tiny_checkpoint(tempfile.mkdtemp(prefix="tiny-ming-"))
    from omnistage.services.thinker.models.config import ThinkerConfig

    prompts = _prompts(args.prompts, ThinkerConfig.from_checkpoint(ckpt).vocab_size - 16)
    ref_logits, ref_tokens, _ = _run(ckpt, "cpu", "float32", 1, prompts, args.max_tokens)
    print(f"GPUs: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    rows = []
    for tp in (int(x) for x in args.tp.split(",")):
        if tp > torch.cuda.device_count():
            print(f"skip TP={tp}: only {torch.cuda.device_count()} GPUs")
            continue
        for dtype in ("float32", "bfloat16"):
            logits, tokens, speed = _run(ckpt, "cuda", dtype, tp, prompts, args.max_tokens)
            rel = ((logits - ref_logits).norm() / ref_logits.norm()).item()
            identical = sum(a == b for a, b in zip(tokens, ref_tokens, strict=True))
            agree = [agreed_steps(a, b) for a, b in zip(tokens, ref_tokens, strict=True)]
            rows.append((tp, dtype, rel, identical, min(agree), sum(agree) / len(agree), speed))
    print(
        "\n| TP | dtype | first-step logits rel. err vs CPU fp32 | prompts with identical greedy tokens "
        f"({args.max_tokens}) | min / mean agreeing prefix | out tok/s c=1 / 8 / 32 |"
    )
    print("|---|---|---|---|---|---|")
    for tp, dtype, rel, identical, amin, amean, speed in rows:
        sp = " / ".join(f"{speed[c]:.0f}" for c in (1, 8, 32))
        print(f"| {tp} | {dtype} | {rel:.2e} | {identical}/{len(prompts)} | {amin} / {amean:.1f} | {sp} |")


if __name__ == "__main__":
    main()
