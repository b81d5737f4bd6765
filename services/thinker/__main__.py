"""`python -m omnistage.services.thinker --config F --service NAME --rank R`: one thinker rank."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from omnistage.common import metrics
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.log import get_logger
from omnistage.common.memory.report import export_memory
from omnistage.common.runtime import progress
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.device_loop import DeviceFailed
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.common.transport import TransportContext, TransportOptions
from omnistage.services.thinker.engine.grammar_compiles import GrammarCompiles, GrammarLimits
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine_metrics import EngineMetrics
from omnistage.services.thinker.group.startup import RankConfig, StartedRank, rank0_engine, start_rank
from omnistage.services.thinker.group.worker import run_plan_loop
from omnistage.services.thinker.image_queries import load_image_queries
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.services.thinker.request_flow import ThinkerEngine
from omnistage.services.thinker.server import ThinkerServicer
from omnistage.services.thinker.tp.distributed import GroupFailure, TPControl, TPError
from omnistage.v1 import control_pb2, thinker_pb2_grpc

log = get_logger(__name__)
WARMUP_PROMPT = "<role>HUMAN</role>warm-up<|role_end|><role>ASSISTANT</role>"


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    rank_cfg = RankConfig.from_deploy(cfg, svc, rank)
    started = await in_daemon_thread(
        lambda: start_rank(rank_cfg, progress.StageProgress(runtime)), "thinker-blocking"
    )
    if rank > 0:
        runtime.set_serving()
        await in_daemon_thread(lambda: run_plan_loop(started), "thinker-blocking")
        runtime.request_stop()
        return
    await _serve_rank0(runtime, cfg, svc, started)


def _hidden_states_pool(queries, max_num_seqs: int) -> TransportContext | None:
    """The producer pool hidden states leave through: room for every running request's rows at
    once (2 MiB each for the release in bf16), at most 256 MiB; None without query rows."""
    if queries is None:
        return None
    rows_bytes = queries.numel() * queries.element_size()
    pool = min(256 << 20, max(4 << 20, rows_bytes * max_num_seqs))
    producer = TransportContext(TransportOptions(shm_pool_bytes=pool, cuda_pool_bytes=pool, lease_ttl_s=60.0))
    producer.shm_pool()  # made (and its pages committed) now: a /dev/shm that is too small fails the start
    return producer


def _export_hidden_state_leases(runtime: ServiceRuntime, service: str, producer: TransportContext) -> None:
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


async def _serve_rank0(
    runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, started: StartedRank
) -> None:
    control = started.control
    # Registered first, so it runs last: the store host stays until a failure has been read.
    runtime.add_shutdown_hook(control.close)
    engine = rank0_engine(started)
    model_config = engine.runner.model.config
    queries = load_image_queries(
        cfg.model.checkpoint, model_config.hidden_size, engine.runner.dtype, cfg.model.load_format
    )
    # Consumer side of the encoder's embeddings: its shm pool mapped once, leases released here.
    media = MediaInputs(model_config, engine.runner.dtype, TransportContext(), queries)
    runtime.add_shutdown_hook(media.close)
    producer = _hidden_states_pool(queries, engine.cfg.max_num_seqs)
    if producer is not None:
        runtime.add_shutdown_hook(producer.close)
        _export_hidden_state_leases(runtime, svc.name, producer)
    e = svc.engine
    limits = GrammarLimits(e.grammar_compile_timeout_s, e.grammar_compiles, e.grammar_waiting)
    grammars = GrammarCompiles(engine.tokenizer, asyncio.get_running_loop(), limits)
    runtime.add_shutdown_hook(grammars.close)
    runtime.reporter.progress(detail="the grammar compile server and the tokenizer's grammar info")
    # Seconds of Python on a real vocabulary: now, not at the first structured request (it held the
    # GIL and stalled every stream). The server loads xgrammar meanwhile, in parallel.
    await in_daemon_thread(grammars.start, "thinker-blocking")
    runtime.reporter.progress(detail="one real request through the engine")
    try:
        await in_daemon_thread(lambda: _warm_up(engine, media), "thinker-blocking")
    except Exception as exc:
        raise TPError(_group_failure(control, "the warm-up request", exc)) from exc
    engine.stats = EngineMetrics(svc.name, engine)  # after the warm-up: it counts clients' requests only
    flow = ThinkerEngine(
        engine, asyncio.get_running_loop(), media=media, producer=producer, grammars=grammars
    )
    # A peer's failure may come while the engine thread is blocked inside a collective: the
    # requests are failed from the thread that learns of it.
    control.add_failure_listener(lambda failure: flow.loop.fail(DeviceFailed(failure.message)))

    def on_engine_failure(error: DeviceFailed) -> None:
        failure = _group_failure(control, "serving", error.cause or error)
        runtime.fail(failure.message, failure.rank)

    flow.loop.on_failure.append(on_engine_failure)
    flow.start()
    rcfg = engine.cfg
    runtime.add_shutdown_hook(flow.close)  # its tokenize pool
    runtime.add_servicer(
        thinker_pb2_grpc.add_ThinkerServicer_to_server, ThinkerServicer(flow), "omnistage.v1.Thinker"
    )
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=rcfg.max_num_seqs,
            max_queued_requests=rcfg.max_queued_requests,
            max_message_bytes=svc.max_message_bytes,
            max_prompt_tokens=rcfg.max_model_len - 1,
            max_model_len=rcfg.max_model_len,
            default_max_tokens=rcfg.default_max_tokens,
        )
    )
    runtime.set_load_provider(flow.load)
    runtime.set_memory_provider(lambda: [engine.runner.memory_report()])
    export_memory(svc.name, 0, engine.runner.memory_report())
    # The runtime drains in-flight RPCs first; only then does the engine stop (and release the ranks).
    runtime.add_shutdown_hook(flow.stop)
    runtime.set_serving()


def _group_failure(control: TPControl, where: str, exc: BaseException) -> GroupFailure:
    """The group's failure behind `exc`; an error of rank 0's own is reported to the group first."""
    if isinstance(exc, TPError):
        return exc.failure
    if isinstance(exc, DeviceFailed) and control.failure is not None:
        return control.failure
    return control.fail(where, exc)


def _warm_up(engine: LLMEngine, media: MediaInputs) -> None:
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


def main() -> None:
    run_service(sys.argv[1:], "thinker", build)


if __name__ == "__main__":
    main()
