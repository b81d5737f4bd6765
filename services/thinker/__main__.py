"""`python -m omnistage.services.thinker --config F --service NAME --rank R`: one thinker rank.

Every rank goes through the same start-up phases: loading_weights → profiling_memory (KV auto-profile,
agreed by all ranks) → warming_up (dummy shapes, all ranks run or skip each) → serving. Rank 0 then
warms up with one real request and serves `omnistage.v1.Thinker`; ranks 1..N-1 execute its step plans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.report import export_memory
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.engine.warmup import Report
from omnistage.services.thinker.engine.worker import run_worker
from omnistage.services.thinker.engine_loop import EngineLoop
from omnistage.services.thinker.server import ThinkerServicer
from omnistage.v1 import control_pb2, thinker_pb2_grpc

WARMUP_PROMPT = "<role>HUMAN</role>warm-up<|role_end|><role>ASSISTANT</role>"


def _in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run blocking work off the event loop in a daemon thread, so a stop never waits for it."""
    fut: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            fut.set_exception(exc)

    threading.Thread(target=run, name="thinker-blocking", daemon=True).start()
    return asyncio.wrap_future(fut)


def _device(svc: ServiceConfig, rank: int) -> str:
    if svc.device == "cpu":
        return "cpu"
    gpus = svc.gpus or tuple(range(svc.tp_size))
    return f"cuda:{gpus[rank]}"


def _shard_progress(runtime: ServiceRuntime) -> Callable[[int, int], None]:
    def progress(done: int, total: int) -> None:
        runtime.reporter.progress(done, total=total, detail=f"{done}/{total} shards")

    return progress


_PHASE_UNITS = {"loading_weights": "shards", "profiling_memory": "attempts", "warming_up": "shapes"}


def _phase_report(runtime: ServiceRuntime, first: str) -> Report:
    """Start-up phases from the start-up thread (every rank): loading_weights → profiling_memory (probe,
    stress, agree, rebuild, canary, validate, attempt k/4) → warming_up (shape by shape)."""
    current = [first]

    def report(phase: str, detail: str = "", done: int = 0, total: int = 0) -> None:
        if phase == "failed":  # this rank's own failure, reported before it lingers for the others
            runtime.reporter.fail(detail)
        elif phase != current[0]:
            current[0] = phase
            runtime.reporter.enter(phase, total=total, unit=_PHASE_UNITS.get(phase, ""), detail=detail)
        elif detail:
            runtime.reporter.progress(done, total=total or None, detail=detail)

    return report


def _on_peer_failure(runtime: ServiceRuntime, grace_s: float = 5.0) -> Callable[[str], None]:
    """Another rank failed while this one may be stuck in a collective: fail now, exit after a grace."""

    def handler(diagnostic: str) -> None:
        runtime.fail(diagnostic)
        time.sleep(grace_s)
        logging.shutdown()
        os._exit(1)

    return handler


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    common = dict(
        ckpt_dir=cfg.model.checkpoint,
        engine_cfg=svc.engine,
        dtype=svc.dtype,
        device=_device(svc, rank),
        world_size=svc.tp_size,
        host=cfg.host,
        port=svc.dist_port,
        timeout_s=cfg.startup.phase_deadlines_s.get("loading_weights", 900.0),
        progress=_shard_progress(runtime),
        memory=svc.memory,
        report=_phase_report(runtime, "loading_weights"),
        on_peer_failure=_on_peer_failure(runtime),
    )
    runtime.reporter.enter("loading_weights", unit="shards")
    if rank > 0:
        await _serve_worker(runtime, common, rank)
        return
    engine: LLMEngine = await _in_daemon_thread(lambda: LLMEngine.from_checkpoint(rank=0, **common))
    runtime.reporter.progress(detail="one real request through the engine")
    await _in_daemon_thread(lambda: _warm_up(engine))
    loop = EngineLoop(engine, asyncio.get_running_loop())
    loop.on_failure = lambda exc: runtime.fail(f"engine failed: {type(exc).__name__}: {exc}")
    loop.start()
    tokenizer = engine.tokenizer
    rcfg = engine.cfg
    servicer = ThinkerServicer(loop, tokenizer, rcfg.max_model_len)
    runtime.add_servicer(thinker_pb2_grpc.add_ThinkerServicer_to_server, servicer, "omnistage.v1.Thinker")
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
    runtime.set_load_provider(loop.load)
    runtime.set_memory_provider(lambda: [engine.runner.memory_report()])
    export_memory(svc.name, rank, engine.runner.memory_report())
    # The runtime drains in-flight RPCs first; only then does the engine stop (and release the ranks).
    runtime.add_shutdown_hook(loop.stop)
    runtime.set_serving()


def _warm_up(engine: LLMEngine) -> None:
    """One real request through the whole engine: SERVING means a forward has really run."""
    prompt = engine.tokenizer.encode(WARMUP_PROMPT)
    started = time.monotonic()
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=2, ignore_eos=True), timeout_s=600.0)
    if len(result.token_ids) != 2:
        raise RuntimeError(f"warm-up produced {len(result.token_ids)} tokens, expected 2")
    engine.last_warmup_s = time.monotonic() - started


async def _serve_worker(runtime: ServiceRuntime, common: dict, rank: int) -> None:
    """Ranks 1..N-1: SERVING once the shard is loaded; leave when rank 0 sends the exit plan."""
    ready = threading.Event()
    done = _in_daemon_thread(lambda: run_worker(rank=rank, on_ready=ready.set, **common))
    while not ready.is_set() and not done.done():
        await asyncio.sleep(0.05)
    if done.done():
        done.result()  # raises the worker's diagnostic
        return
    runtime.set_serving()
    await done
    runtime.request_stop()


def main() -> None:
    run_service(sys.argv[1:], "thinker", build)


if __name__ == "__main__":
    main()
