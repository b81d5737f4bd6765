"""Issue 39's correctness check on the GPU: the fp32 greedy tokens of every attention × MoE backend
combination equal the CPU engine's for `--steps` steps, and FlashInfer (bf16 only) agrees with Triton.

    python bench/prefill_check.py [--steps 64] [--out DIR]

The tiny checkpoint (random weights, written here), TP=1 on cuda:0. Each round sends its prompts
together — lengths from 5 to 600 tokens, so prefill chunks (max_num_batched_tokens 256), mixed steps
and decode graphs all run — and the second round's prompts start with the first round's, so they
take cached prefix blocks. fp32: every combination must give exactly the CPU's tokens (FlashInfer
refuses fp32 and falls back to Triton there: its fp32 row checks the fallback). bf16: FlashInfer's
and Triton's tokens, compared up to the first divergence (bf16 rounding may flip a near-tie of the
random tiny model). Writes OUT/prefill_check.json; exits 1 when an fp32 combination differs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.tiny import write_tiny_checkpoint
from omnistage.common.config import EngineConfig
from omnistage.common.log import setup_logging
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine_check import agreed_steps  # noqa: E402

CFG = EngineConfig(block_size=16, max_num_seqs=32, max_num_batched_tokens=256, max_model_len=1024)
COMBOS = [(a, m) for a in ("torch", "triton", "flashinfer") for m in ("torch", "triton")]


def rounds(vocab: int) -> list[list[list[int]]]:
    """Two rounds of prompts; the second's start with the first's (prefix-cache hits beside decodes)."""
    rng = random.Random(0)
    first = [[rng.randrange(0, vocab) for _ in range(n)] for n in (5, 37, 120, 300, 600)]
    second = [p[: len(p) // 2 + 17] + [rng.randrange(0, vocab) for _ in range(9)] for p in first[1:]]
    return [first, second]


def tokens(ckpt: Path, device: str, attention: str, moe: str, dtype: str, steps: int) -> list[list[int]]:
    cfg = RankConfig(
        str(ckpt), replace(CFG, attention_backend=attention, moe_backend=moe), dtype=dtype, device=device
    )
    engine = rank0_engine(start_rank(cfg))
    try:
        greedy = SamplingParams(max_tokens=steps, ignore_eos=True)
        vocab = engine.tokenizer.vocab_size
        return [r.token_ids for prompts in rounds(min(vocab, 900)) for r in engine.generate(prompts, greedy)]
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument(
        "--device", default="cuda:0", help="cpu: a smoke run of this script under TRITON_INTERPRET=1"
    )
    args = ap.parse_args()
    setup_logging("prefill-check", level="warning")
    started = time.monotonic()
    result: dict = {"steps": args.steps, "fp32_equal_cpu": {}, "fp32_agreed_steps": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        cpu = tokens(ckpt, "cpu", "torch", "torch", "float32", args.steps)
        for attention, moe in COMBOS:
            name = f"attention={attention},moe={moe}"
            got = tokens(ckpt, args.device, attention, moe, "float32", args.steps)
            result["fp32_equal_cpu"][name] = got == cpu
            result["fp32_agreed_steps"][name] = [agreed_steps(a, b) for a, b in zip(got, cpu, strict=True)]
            print(f"fp32 {name}: {'equal' if got == cpu else 'DIFFERENT'}", flush=True)
        bf16 = {
            a: tokens(ckpt, "cuda:0", a, "triton", "bfloat16", args.steps) for a in ("triton", "flashinfer")
        }
        result["bf16_flashinfer_vs_triton_agreed_steps"] = [
            agreed_steps(a, b) for a, b in zip(bf16["flashinfer"], bf16["triton"], strict=True)
        ]
    result["seconds"] = round(time.monotonic() - started, 1)
    print(json.dumps(result), flush=True)
    if args.out:
        write_result(Path(args.out, "prefill_check.json"), result, gpu=args.device != "cpu")
    return 0 if all(result["fp32_equal_cpu"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
