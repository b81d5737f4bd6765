"""The thinker engine's Prometheus metrics, recorded once per step on rank 0's engine thread."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from omnistage.common import metrics
from omnistage.services.thinker.engine.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from omnistage.services.thinker.engine.llm_engine import LLMEngine
    from omnistage.services.thinker.engine.scheduler import ScheduledBatch

FINISH_REASONS = tuple(r.value for r in FinishReason)


def step_phase_histograms(service: str) -> dict[tuple[str, str], object]:
    """omnistage_thinker_step_phase_seconds by (phase, step kind), exported from the start."""
    phases = metrics.histogram(
        "thinker_step_phase_seconds",
        "Host time of one engine step by phase (schedule, plan, launch, sample, wait, output) and kind "
        "(prefill: it computes prompt tokens; decode); on a GPU the forward's device time ends "
        "inside `wait`, which waits for the sampled ids (with async scheduling, those of the step "
        "before the one launched)",
        ("phase", "step"),
        buckets=metrics.FINE_BUCKETS_S,
    )
    return {
        (p, k): phases.labels(service, p, k)
        for p in ("schedule", "plan", "launch", "sample", "wait", "output")
        for k in ("prefill", "decode")
    }


class EngineMetrics:
    """The `StepObserver` of one LLMEngine (set `engine.stats` after the warm-up)."""

    def __init__(self, service: str, engine: LLMEngine) -> None:
        self.service = service
        self.engine = engine
        label = (service,)
        blocks = engine.scheduler.block_manager
        _export_gauges(service, engine)
        self.queue = metrics.histogram(
            "thinker_queue_time_seconds",
            "Time from a request's arrival in the engine to its first scheduling",
        ).labels(*label)
        self.ttft = metrics.histogram(
            "thinker_ttft_seconds", "Time from a request's arrival in the engine to its first generated token"
        ).labels(*label)
        self.itl = metrics.histogram(
            "thinker_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=metrics.FINE_BUCKETS_S,
        ).labels(*label)
        self.e2e = metrics.histogram(
            "thinker_e2e_seconds",
            "Time from a request's arrival in the engine to its end (any finish reason)",
        ).labels(*label)
        self.prompt_tokens = metrics.counter(
            "thinker_prompt_tokens",
            "Prompt tokens of requests admitted (counted once, at the first admission)",
        ).labels(*label)
        self.generated_tokens = metrics.counter(
            "thinker_generated_tokens", "Tokens generated (sampled)"
        ).labels(*label)
        self.preemptions = metrics.counter(
            "thinker_preemptions",
            "Sequences preempted (KV blocks freed, recomputed on readmission) for want of KV cache",
        ).labels(*label)
        self.blocks = blocks
        self.phases = step_phase_histograms(service)
        self._prefix_cache_metrics(label)
        self._seen = dataclasses.replace(blocks.stats)
        finished = metrics.counter("thinker_requests", "Requests ended, by finish reason", ("finish_reason",))
        self.finished = {r: finished.labels(service, r) for r in FINISH_REASONS}

    def _prefix_cache_metrics(self, label: tuple[str, ...]) -> None:
        """The prefix cache's counters (queries, hits, evictions); its blocks gauge is `_export_gauges`'."""
        self.cache_queries = metrics.counter(
            "thinker_prefix_cache_queries",
            "Tokens of sequences looked up in the prefix cache at admission "
            "(every admission, readmissions after preemption included), in tokens",
        ).labels(*label)
        self.cache_hits = metrics.counter(
            "thinker_prefix_cache_hits",
            "Of the looked-up tokens, those whose KV came from the prefix cache, in tokens",
        ).labels(*label)
        self.cache_evictions = metrics.counter(
            "thinker_prefix_cache_evictions",
            "Cached KV blocks (free, still holding a prefix) handed out for other content",
        ).labels(*label)

    def on_step(self, batch: ScheduledBatch, now: float) -> None:
        self._cache_counts()
        kind = "prefill" if batch.admitted or any(n > 1 for _, n in batch.scheduled) else "decode"
        for phase, seconds in self.engine.step_times.seconds.items():
            self.phases[phase, kind].observe(seconds)
        for seq in batch.admitted:
            self.queue.observe(seq.first_scheduled_time - seq.arrival_time)
            self.prompt_tokens.inc(seq.num_prompt_tokens)
        if batch.preempted:
            self.preemptions.inc(len(batch.preempted))
        sampling = batch.sampling_seqs
        if sampling:
            self.generated_tokens.inc(len(sampling))
            since: dict[float, int] = {}  # previous token time → tokens that waited from it
            for seq in sampling:
                prev = seq.prev_token_time
                if prev is None:
                    self.ttft.observe(now - seq.arrival_time)
                else:
                    since[prev] = since.get(prev, 0) + 1
                if seq.is_finished:
                    self._ended(seq, now)
            for prev, count in since.items():
                metrics.observe_many(self.itl, now - prev, count)
        for seq in batch.completing_hidden:
            self._ended(seq, now)

    def _cache_counts(self) -> None:
        stats, seen = self.blocks.stats, self._seen
        if stats.queried_tokens != seen.queried_tokens:
            self.cache_queries.inc(stats.queried_tokens - seen.queried_tokens)
            self.cache_hits.inc(stats.hit_tokens - seen.hit_tokens)
        if stats.evicted_blocks != seen.evicted_blocks:
            self.cache_evictions.inc(stats.evicted_blocks - seen.evicted_blocks)
        self._seen = dataclasses.replace(stats)

    def on_abort(self, seq: Sequence, now: float) -> None:
        self._ended(seq, now)

    def _ended(self, seq: Sequence, now: float) -> None:
        self.e2e.observe(now - seq.arrival_time)
        reason = seq.finish_reason.value if seq.finish_reason is not None else FinishReason.ERROR.value
        self.finished[reason].inc()


def _export_gauges(service: str, engine: LLMEngine) -> None:
    """The engine's state now, read at scrape time: batch, queue, KV blocks, cached prefixes."""
    scheduler = engine.scheduler
    blocks = scheduler.block_manager
    metrics.gauge(
        "thinker_running_requests", "Sequences in the running batch (holding KV blocks) now"
    ).labels(service).set_function(lambda: len(scheduler.running))
    metrics.gauge(
        "thinker_waiting_requests", "Sequences waiting for admission (new or preempted) now"
    ).labels(service).set_function(lambda: len(scheduler.waiting))
    metrics.gauge("thinker_kv_blocks_used", "KV-cache blocks held by sequences now").labels(
        service
    ).set_function(lambda: blocks.num_blocks - blocks.num_free_blocks)
    metrics.gauge(
        "thinker_kv_blocks_capacity", "KV-cache blocks of the engine (its profiled cache size)"
    ).labels(service).set(blocks.num_blocks)
    metrics.gauge(
        "thinker_prefix_cache_blocks", "KV blocks holding an indexed prefix now (held or free)"
    ).labels(service).set_function(lambda: blocks.num_cached_blocks)
