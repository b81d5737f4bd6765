"""Thinker start-up work of rank 0, once every rank has started: the hidden-state pool, the warm-up
request through the whole engine, and the group's failure behind an error of rank 0's own.

(Each rank's own steps, the same on every rank, are `group/startup.py`.)
"""

from __future__ import annotations

import threading
import time

from omnistage.common import metrics
from omnistage.common.log import get_logger
from omnistage.common.runtime.device_loop import DeviceFailed
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.services.thinker.tp.distributed import GroupFailure, TPControl, TPError

log = get_logger(__name__)
WARMUP_PROMPT = "<role>HUMAN</role>warm-up<|role_end|><role>ASSISTANT</role>"


def hidden_states_pool(queries, max_num_seqs: int) -> TransportContext | None:
    """The producer pool hidden states leave through: room for every running request's rows at
    once (2 MiB each for the release in bf16), at most 256 MiB; None without query rows."""
    if queries is None:
        return None
    rows_bytes = queries.numel() * queries.element_size()
    pool = min(256 << 20, max(4 << 20, rows_bytes * max_num_seqs))
    producer = TransportContext(TransportOptions(shm_pool_bytes=pool, cuda_pool_bytes=pool, lease_ttl_s=60.0))
    producer.shm_pool()  # made (and its pages committed) now: a /dev/shm that is too small fails the start
    return producer


def export_hidden_state_leases(runtime: ServiceRuntime, service: str, producer: TransportContext) -> None:
    """/metrics: hidden states handed out (to the image stage) and not yet released; a leak shows as a
    gauge that never falls back to 0. Reads 0 once the pool is closed (shutdown hooks run last first)."""
    pool, closed = producer.shm_pool(), threading.Event()
    runtime.add_shutdown_hook(closed.set)

    def active() -> int:
        if pool is None or closed.is_set():
            return 0
        pool.arena.reclaim()
        return pool.arena.active_leases

    metrics.gauge(
        "thinker_hidden_state_leases_active", "Hidden-state refs leased to consumers, not yet released"
    ).labels(service).set_function(active)


def group_failure(control: TPControl, where: str, exc: BaseException) -> GroupFailure:
    """The group's failure behind `exc`; an error of rank 0's own is reported to the group first."""
    if isinstance(exc, TPError):
        return exc.failure
    if isinstance(exc, DeviceFailed) and control.failure is not None:
        return control.failure
    return control.fail(where, exc)


def warm_up(engine: LLMEngine, media: MediaInputs) -> None:
    """One real request through the whole engine: SERVING means a forward has really run. With image
    query rows, one hidden-state request too (when its block fits max_model_len)."""
    prompt = engine.tokenizer.encode(WARMUP_PROMPT)
    started = time.monotonic()
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), timeout_s=600.0)
    if len(result.token_ids) != 2:
        raise RuntimeError(f"warm-up produced {len(result.token_ids)} tokens, expected 2")
    if media.queries is not None:
        if len(prompt) + media.query_block_tokens > engine.cfg.max_model_len:
            log.warning(
                "max_model_len %d leaves no room for the image query block (%d tokens): hidden-state "
                "requests will be refused",
                engine.cfg.max_model_len,
                media.query_block_tokens,
            )
        else:
            hidden = media.build(prompt, [], image_queries=True)
            (result,) = engine.generate([hidden], SamplingParams(), timeout_s=600.0)
            want = tuple(media.queries.shape)
            if result.hidden_states is None or tuple(result.hidden_states.shape) != want:
                got = None if result.hidden_states is None else tuple(result.hidden_states.shape)
                raise RuntimeError(f"the hidden-state warm-up returned {got}, expected {want}")
    engine.last_warmup_s = time.monotonic() - started
