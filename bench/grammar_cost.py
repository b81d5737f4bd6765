"""The cost of grammar-constrained sampling per decode step, on the CPU tiny tokenizer (not a test).

    python bench/grammar_cost.py [--ckpt .cache/tiny-ming] [--batches 1,8,32] [--steps 200]

Runs the thinker's Sampler on random logits [B, V] for B sequences, every row constrained by a JSON
Schema (an object of enums, bounded integers and numbers, booleans and a bounded array: the shape of
tool arguments) against the same rows unconstrained; a row whose JSON is complete starts again.
Reports the sampler's ms per step both ways (medians after a warm-up; the CPU is shared, so they are
noisy) and, measured around the constraint's own calls, its µs per step and per row (bitmask fill on
the host on its own thread, apply, accept).
Writes JSON to $OUT/grammar_cost.json when $OUT is set. The tiny vocabulary is ~1.5 k tokens; the
release's is 157 k, for which the mask fill and apply cost more (xgrammar's fill is mostly cached
per grammar state).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.services.thinker.engine.grammar import Grammars, GrammarSpec
from omnistage.services.thinker.engine.grammar_masks import GrammarMasks, PendingMask
from omnistage.services.thinker.engine.sampler import Sampler
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence
from omnistage.services.thinker.models.tokenizer import MingTokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"enum": ["Paris", "Lima", "Hangzhou"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
    },
    "required": ["city", "days", "score", "flags"],
    "additionalProperties": False,
}


_spent = [0.0]


def _timed(fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _spent[0] += time.perf_counter() - start

    return wrapper


# Here no forward runs between the fill's start and the mask's use: `apply` waits for all of it.
GrammarMasks.begin = _timed(GrammarMasks.begin)
PendingMask.apply = _timed(PendingMask.apply)
PendingMask.accept = _timed(PendingMask.accept)
_MASKS = GrammarMasks()


def step_ms(sampler: Sampler, seqs: list[Sequence], vocab: int, steps: int, params: SamplingParams) -> float:
    times = []
    for i in range(-10, steps):  # 10 warm-up steps
        if i == 0:
            _spent[0] = 0.0
        logits = torch.randn(len(seqs), vocab, generator=torch.Generator().manual_seed(i))
        start = time.perf_counter()
        out = sampler(logits, seqs, _MASKS.begin(seqs))
        if i >= 0:
            times.append(time.perf_counter() - start)
        for j, (seq, token) in enumerate(zip(seqs, out.token_ids, strict=True)):
            seq.token_ids.append(token)
            if seq.matcher is not None and seq.matcher.state.is_terminated():
                seqs[j] = Sequence(seq.request_id, [1], params, 64)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", default=".cache/tiny-ming")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    tok = MingTokenizer(args.ckpt)
    grammar = Grammars(tok).compile(GrammarSpec("json_schema", json.dumps(SCHEMA)))
    sampler = Sampler()
    rows = []
    for batch in map(int, args.batches.split(",")):
        result = {"batch": batch, "vocab": tok.vocab_size}
        for name, params in (
            ("free", SamplingParams(temperature=1.0, seed=1)),
            ("constrained", SamplingParams(temperature=1.0, seed=1, grammar=grammar)),
        ):
            seqs = [Sequence(f"r{i}", [1], params, 64) for i in range(batch)]
            result[f"{name}_ms"] = step_ms(sampler, seqs, tok.vocab_size, args.steps, params)
        result["constraint_us_per_step"] = _spent[0] / args.steps * 1e6
        result["constraint_us_per_row"] = result["constraint_us_per_step"] / batch
        rows.append(result)
    print("| batch | vocab | sampler ms/step free | constrained | constraint µs/step | µs/row |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['batch']} | {r['vocab']} | {r['free_ms']:.3f} | {r['constrained_ms']:.3f} | "
            f"{r['constraint_us_per_step']:.0f} | {r['constraint_us_per_row']:.1f} |"
        )
    if os.environ.get("OUT"):  # the sampler's host-side cost: a CPU measurement wherever it runs
        write_result(Path(os.environ["OUT"], "grammar_cost.json"), {"device": "cpu", "rows": rows}, gpu=False)


if __name__ == "__main__":
    main()
