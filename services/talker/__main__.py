"""`python -m omnistage.services.talker --config F --service NAME`: the talker (text to speech) stage.

Start-up phases: loading_weights (talker shards, the VAE, CAM++, then the preset voices encoded once)
→ profiling_memory (stress-and-cap of the streams speaking at once) → warming_up (one sentence
through the whole Speak path) → serving `omnistage.v1.Talker`. CPU or one GPU (`gpus[0]`).
"""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import torch
from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.device import device_memory_for
from omnistage.common.memory.report import export_memory
from omnistage.common.memory.stress import ConcurrencyLimiter
from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.services.talker import startup
from omnistage.services.talker.engine import TalkerEngine
from omnistage.services.talker.metrics import StepMetrics, export_engine_gauges, export_queue_time
from omnistage.services.talker.models.config import TALKER_DIR
from omnistage.services.talker.models.loader import load_talker
from omnistage.services.talker.runner import TalkerRunner
from omnistage.services.talker.server import TalkerServicer
from omnistage.services.talker.session import SpeakSession
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voices import VoiceBank
from omnistage.v1 import control_pb2, talker_pb2_grpc


def _device(svc: ServiceConfig) -> str:
    return "cpu" if svc.device == "cpu" else f"cuda:{(svc.gpus or (0,))[0]}"


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    device = _device(svc)
    dtype = getattr(torch, svc.dtype)
    tcfg = svc.talker
    mem = device_memory_for(device, svc.memory.simulated_capacity_bytes or None)
    budget = svc.memory.budget_of(mem.total())
    if budget and hasattr(mem, "set_limit"):
        mem.set_limit(budget)
    reporter = runtime.reporter

    def report(phase: str, detail: str) -> None:
        if reporter.phase != phase:
            reporter.enter(phase, detail=detail)
        else:
            reporter.heartbeat(detail)

    def progress(done: int, total: int) -> None:
        reporter.progress(done, total=total, detail=f"{done}/{total} shards")

    def load_and_profile():
        with mem.meter():
            models = load_talker(cfg.model.checkpoint, dtype=dtype, device=device, progress=progress,
                                 dummy=cfg.model.load_format == "dummy")
            speaker = SpeakerEncoder(Path(cfg.model.checkpoint) / TALKER_DIR / "campplus.onnx", tcfg.speaker_threads)
            voices = VoiceBank(models, speaker, tcfg.default_voice, tcfg.max_reference_seconds)
            reporter.heartbeat("encoding the preset voices")
            voices.load_presets(tcfg.voice_seed)
            reporter.enter("profiling_memory", unit="attempts")
            prof = startup.profile(models, mem, tcfg, budget, report, speaker.dim)
            runner = TalkerRunner(models, prof.max_streams, prof.caches.lm_tokens, prof.caches.vae_frames,
                                  temperature=tcfg.temperature, sigma=tcfg.sigma, graphs=startup.graphs_on(models, tcfg))
            if runner.static is not None:
                reporter.heartbeat(f"capturing {runner.static.capture_all()} step graphs")
        return models, voices, prof, runner

    reporter.enter("loading_weights", unit="shards")
    models, voices, prof, runner = await in_daemon_thread(load_and_profile, "talker-startup")

    reporter.enter("warming_up", detail="one sentence through the Speak path")
    engine = TalkerEngine(runner, service=svc.name, on_step=StepMetrics(svc.name),
                          on_failure=lambda exc: runtime.fail(str(exc)))
    engine.start()
    pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"{svc.name}-clip")
    runtime.add_shutdown_hook(lambda: pool.shutdown(wait=False, cancel_futures=True))
    runtime.add_shutdown_hook(engine.stop)
    await startup.warm_up(SpeakSession(engine, voices, tcfg, pool, svc.name))

    limiter = ConcurrencyLimiter(f"{svc.name} streams", prof.max_streams)
    servicer = TalkerServicer(engine, voices, tcfg, limiter, pool, svc.name)
    runtime.add_servicer(talker_pb2_grpc.add_TalkerServicer_to_server, servicer, "omnistage.v1.Talker")
    runtime.set_limits_provider(lambda: control_pb2.Limits(
        max_running_requests=prof.max_streams, max_message_bytes=svc.max_message_bytes))
    runtime.set_load_provider(lambda: (limiter.in_use, engine.jobs_queued))
    export_engine_gauges(engine, svc.name)
    export_queue_time(engine, svc.name)

    def memory() -> list[control_pb2.MemoryReport]:
        report = prof.memory_report(mem, models.weights_bytes, runner.cache_bytes)
        report.budget_bytes = budget
        return [report]

    runtime.set_memory_provider(memory)
    export_memory(svc.name, rank, memory()[0])
    runtime.set_serving()


def main() -> None:
    run_service(sys.argv[1:], "talker", build)


if __name__ == "__main__":
    main()
