"""Dummy steps (the shapes profiling and warm-up run) and the rank-agreed warm-up."""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omnistage.common.log import get_logger
from omnistage.common.memory.device import DeviceMemory, fmt_bytes
from omnistage.services.thinker.engine.config import ResolvedEngineConfig
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sampler import Sampler
from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence
from omnistage.services.thinker.tp.distributed import TPControl
from omnistage.services.thinker.tp.plan import PlanKind, StepPlan

log = get_logger(__name__)

# Sampling that allocates every buffer the sampler has (penalties, temperature, top-k/top-p/min-p
# sort, exponential draw, logprobs): a greedy dummy run would miss the sort (LightLLM's lesson).
DUMMY_SAMPLING = SamplingParams(
    temperature=0.8,
    top_k=50,
    top_p=0.9,
    min_p=0.01,
    repetition_penalty=1.1,
    presence_penalty=0.1,
    seed=0,
    logprobs=5,
    max_tokens=1,
)

# progress(detail, done, total): a start-up step within the current phase (a shape, an attempt).
StepProgress = Callable[[str, int, int], None]


class WarmupError(RuntimeError):
    """A warm-up shape failed on some rank; the message names that rank and the shape."""


@dataclass(frozen=True)
class DummyShape:
    """One step's layout: new tokens and context per sequence, and whether each sequence samples."""

    name: str
    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    sample: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def num_sample_rows(self) -> int:
        return self.num_seqs if self.sample else 0

    def blocks_needed(self, block_size: int) -> int:
        """KV blocks the shape reads (all its sequences share them)."""
        return -(-max(self.context_lens) // block_size)


def prefill_stress_shape(cfg: ResolvedEngineConfig) -> DummyShape:
    """The largest prefill step: max_num_batched_tokens new tokens, each chunk at max context.

    A chunk is not a request's last one, so it samples nothing (no LM head)."""
    total, length = cfg.max_num_batched_tokens, cfg.max_model_len
    chunks = [length] * (total // length) + ([total % length] if total % length else [])
    return DummyShape(
        f"prefill {total} tokens @ ctx {length}", tuple(chunks), (length,) * len(chunks), sample=False
    )


def decode_stress_shape(cfg: ResolvedEngineConfig) -> DummyShape:
    """The largest decode step: max_num_seqs sequences at max context, every one sampling."""
    seqs = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
    length = cfg.max_model_len
    return DummyShape(f"decode {seqs} seqs @ ctx {length}", (1,) * seqs, (length,) * seqs, sample=True)


def decode_short_shape(cfg: ResolvedEngineConfig) -> DummyShape:
    """The decode stress's batch at one KV block of context: a first burst's first steps, and beside
    the decode stress the other end of how a step grows with context (decode_pace.py)."""
    stress, ctx = decode_stress_shape(cfg), min(cfg.block_size, cfg.max_model_len)
    return DummyShape(
        f"decode {stress.num_seqs} seqs @ ctx {ctx}", stress.query_lens, (ctx,) * stress.num_seqs, True
    )


def stress_shapes(cfg: ResolvedEngineConfig) -> list[DummyShape]:
    """What the KV auto-profile measures and validates: the worst prefill and the worst decode."""
    return [prefill_stress_shape(cfg), decode_stress_shape(cfg)]


def _prompt_shape(cfg: ResolvedEngineConfig, tokens: int) -> DummyShape:
    n = min(tokens, cfg.max_num_batched_tokens, cfg.max_model_len - 1)
    return DummyShape(f"prompt {n} tokens", (n,), (n,), sample=True)


def _prompt_shapes(cfg: ResolvedEngineConfig) -> list[DummyShape]:
    """Whole prompts that sample, smallest first: every power of two from 16 tokens to the largest a
    step holds. The kernels pick their variants by a prompt's size in power-of-two bands (the fused
    MoE's tiles by `pairs_bucket`, the router's ROUTE_TABLE rows), so one prompt a band compiles each
    variant a prompt can meet -- on a fresh machine a variant met first by a request costs it ~0.5 s
    (one H200: a 128-token prompt's MoE tiles, which neither 64 nor 512 tokens pick)."""
    largest = min(cfg.max_num_batched_tokens, cfg.max_model_len - 1)
    sizes = [1 << k for k in range(4, largest.bit_length()) if 1 << k <= largest]
    return [_prompt_shape(cfg, n) for n in sorted({*sizes, largest}) if n > 0]


def _small_decode_shape(cfg: ResolvedEngineConfig) -> DummyShape:
    return DummyShape("decode 1 seq @ ctx 1 block", (1,), (min(cfg.block_size, cfg.max_model_len),), True)


def warmup_shapes(cfg: ResolvedEngineConfig) -> list[DummyShape]:
    """Largest first (the caching allocator keeps their blocks), then whole prompts that sample (kernel
    variants the stress shapes miss: the fused MoE's smaller tile bands, a fresh prompt's attention,
    a first sample; FlashInfer builds its kernels in the first), then the full batch's and the common
    small decode at a short context: no request pays a kernel's first build."""
    return [*stress_shapes(cfg), *_prompt_shapes(cfg), decode_short_shape(cfg), _small_decode_shape(cfg)]


def minimal_warmup_shapes(cfg: ResolvedEngineConfig) -> list[DummyShape]:
    """A plain CPU's warm-up (`RankConfig.full_warmup` false), each on every rank: a 64-token prompt
    and the small decode run every path of a step once (prefill, decode, every sampler buffer,
    the group's agreement); then the full batch's decode at one KV block and at max_model_len, the two
    steps Describe's decode_step_times reports (decode_pace.py), timed after the first decode's
    first-use costs. Torch eager builds no kernels and there is no device memory to prove (the KV cache
    is sized from the config), so the prefill stress and the other prompts would only cost time."""
    return [
        _prompt_shape(cfg, 64),
        _small_decode_shape(cfg),
        decode_short_shape(cfg),
        decode_stress_shape(cfg),
    ]


def dummy_plan(shape: DummyShape, block_size: int) -> StepPlan:
    """A StepPlan for `shape` whose sequences all use KV blocks 0..n-1 (token ids are small and valid)."""
    table = list(range(shape.blocks_needed(block_size)))
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[int] = []
    for qlen, ctx in zip(shape.query_lens, shape.context_lens, strict=True):
        for p in range(ctx - qlen, ctx):
            ids.append(1 + p % 97)
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        if shape.sample:
            rows.append(len(ids) - 1)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    pos = t(positions)
    return StepPlan(
        kind=PlanKind.RUN,
        input_ids=t(ids),
        positions=pos[None].expand(3, -1).contiguous(),
        query_lens=t(list(shape.query_lens)),
        context_lens=t(list(shape.context_lens)),
        slot_mapping=t(slots),
        block_tables=t(table * shape.num_seqs).view(shape.num_seqs, len(table)),
        sample_rows=t(rows),
    )


def dummy_sampling_seqs(n: int) -> list[Sequence]:
    """Sequences that exercise every sampler path (one output token, so presence penalties apply)."""
    seqs = []
    for i in range(n):
        seq = Sequence(f"dummy-{i}", [1, 2, 3], DUMMY_SAMPLING, max_tokens=1)
        seq.token_ids.append(4)
        seqs.append(seq)
    return seqs


def run_dummy_step(runner: ModelRunner, shape: DummyShape, sampler: Sampler | None = None) -> None:
    """One forward of `shape` (plus the sampler on the rank that gets logits: every path, then the
    plain greedy one, which reads the model-dtype logits as they are: its argmax's own build for
    that dtype, not a first request's). Keeps nothing."""
    needed = shape.blocks_needed(runner.cfg.block_size)
    if needed > runner.num_kv_blocks:
        raise ValueError(
            f"dummy step {shape.name!r} needs {needed} KV blocks, the cache has {runner.num_kv_blocks}"
        )
    logits = runner.execute(dummy_plan(shape, runner.cfg.block_size))
    if logits is not None and sampler is not None:
        sampler(logits, dummy_sampling_seqs(logits.shape[0]))
        sampler(logits, [Sequence(f"greedy-{i}", [1], SamplingParams(), 1) for i in range(logits.shape[0])])


def release_after_failure(mem: DeviceMemory | None) -> None:
    """After a caught failure: drop the tensors the traceback kept alive and return cached blocks."""
    gc.collect()
    if mem is not None:
        mem.empty_cache()


# --- the rank-agreed warm-up --------------------------------------------------------------------


@dataclass
class WarmupResult:
    ran: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # Seconds each shape's step took on the device, the fastest of its runs (a first run builds kernels).
    shape_s: dict[str, float] = field(default_factory=dict)

    def timed(self, shape: DummyShape, seconds: float) -> None:
        self.ran.append(shape.name)
        self.shape_s[shape.name] = min(seconds, self.shape_s.get(shape.name, math.inf))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: a step's time is its device time, not its launch's."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def shape_readiness(
    runner: ModelRunner, shape: DummyShape, mem: DeviceMemory | None, cap_bytes: int, need_bytes: int
) -> str:
    """Why this rank cannot run `shape` now; "" when it can."""
    cfg = runner.cfg
    needed = shape.blocks_needed(cfg.block_size)
    if needed > runner.num_kv_blocks:
        return f"needs {needed} KV blocks, the cache has {runner.num_kv_blocks}"
    if shape.num_tokens > cfg.max_num_batched_tokens or shape.num_seqs > cfg.max_num_seqs:
        return f"{shape.num_tokens} tokens / {shape.num_seqs} seqs exceed the engine limits"
    if max(shape.context_lens) > cfg.max_model_len:
        return f"context {max(shape.context_lens)} exceeds max_model_len {cfg.max_model_len}"
    if mem is not None and cap_bytes and need_bytes:
        free = cap_bytes - mem.allocated()
        if free < need_bytes:
            return f"{fmt_bytes(free)} free of its budget, the shape needs {fmt_bytes(need_bytes)}"
    return ""


def run_warmup(
    runner: ModelRunner,
    control: TPControl,
    shapes: list[DummyShape],
    *,
    mem: DeviceMemory | None = None,
    cap_bytes: int = 0,
    need_bytes: dict[str, int] | None = None,
    sampler: Sampler | None = None,
    progress: StepProgress | None = None,
) -> WarmupResult:
    """Run each shape on every rank or on none; any failure fails every rank (WarmupError)."""
    need = need_bytes or {}
    default_need = max(need.values(), default=0)
    sampler = sampler or Sampler()
    result = WarmupResult()
    started = time.monotonic()
    for i, shape in enumerate(shapes):
        if progress is not None:
            progress(shape.name, i, len(shapes))
        why = shape_readiness(runner, shape, mem, cap_bytes, need.get(shape.name, default_need))
        all_ready, first_bad = control.agree_all(not why, f"warm-up readiness of {shape.name!r}")
        if not all_ready:
            log.warning(
                "warm-up shape %r skipped on every rank: rank %d is not ready%s",
                shape.name,
                first_bad,
                f" ({why})" if why else "",
            )
            result.skipped.append(shape.name)
            continue
        diagnostic, step_started = "", time.monotonic()
        try:
            run_dummy_step(runner, shape, sampler)
            synchronize(runner.device)
        except Exception as exc:
            diagnostic = control.fail(f"warm-up shape {shape.name!r}", exc).message
        if diagnostic:  # outside the except block: the traceback (and its tensors) is gone by now
            release_after_failure(mem)
            raise WarmupError(diagnostic)
        result.timed(shape, time.monotonic() - step_started)
    if progress is not None:
        progress("done", len(shapes), len(shapes))
    result.seconds = time.monotonic() - started
    log.info("warm-up: ran %s, skipped %s in %.2fs", result.ran, result.skipped or "none", result.seconds)
    return result
