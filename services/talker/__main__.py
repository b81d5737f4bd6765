"""`python -m omnistage.services.talker --config F --service NAME`: the talker (text to speech) stage.

Start-up phases (common/runtime/boot.py): loading_weights (talker shards, the VAE, CAM++, then the
preset voices encoded once) → profiling_memory (stress-and-cap of the streams speaking at once, then
the step graphs captured for that many) → warming_up (one sentence through the whole Speak path) →
serving `omnistage.v1.Talker`. CPU or one GPU (`gpus[0]`).
"""

from __future__ import annotations

import concurrent.futures
import functools
import sys
from pathlib import Path

from omnistage.common.runtime.boot import StageStartup, run_stage
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
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


class TalkerStartup(StageStartup):
    warm_up_detail = "one sentence through the Speak path"

    def load(self) -> None:
        b, tcfg = self.boot, self.boot.svc.talker
        self.models = load_talker(
            b.checkpoint, dtype=b.dtype, device=b.device, progress=b.progress.shards, dummy=b.dummy_weights
        )
        self.speaker = SpeakerEncoder(Path(b.checkpoint) / TALKER_DIR / "campplus.onnx", tcfg.speaker_threads)
        self.voices = VoiceBank(self.models, self.speaker, tcfg.default_voice, tcfg.max_reference_seconds)
        b.progress.heartbeat("encoding the preset voices")
        self.voices.load_presets(tcfg.voice_seed)

    def stress(self) -> None:
        b, tcfg = self.boot, self.boot.svc.talker
        self.profile = startup.profile(
            self.models, b.mem, tcfg, b.allocator_budget, b.progress.in_phase, self.speaker.dim
        )
        caches = self.profile.caches
        self.runner = TalkerRunner(
            self.models,
            self.profile.max_streams,
            caches.lm_tokens,
            caches.vae_frames,
            temperature=tcfg.temperature,
            sigma=tcfg.sigma,
            graphs=startup.graphs_on(self.models, tcfg),
        )
        self.graph_pool_bytes = 0
        if self.runner.static is not None:
            before = b.mem.reserved()
            b.progress.heartbeat(f"capturing {self.runner.static.capture_all()} step graphs")
            self.graph_pool_bytes = max(b.mem.reserved() - before, 0)

    async def warm_up(self) -> None:
        svc, runtime = self.boot.svc, self.boot.runtime
        self.engine = TalkerEngine(
            self.runner,
            service=svc.name,
            on_step=StepMetrics(svc.name),
            on_failure=lambda exc: runtime.fail(str(exc)),
        )
        self.engine.start()
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"{svc.name}-clip")
        runtime.add_shutdown_hook(lambda: self.pool.shutdown(wait=False, cancel_futures=True))
        runtime.add_shutdown_hook(self.engine.stop)
        self.new_session = functools.partial(
            SpeakSession, self.engine, self.voices, svc.talker, self.pool, svc.name
        )
        await startup.warm_up(self.new_session())

    def serve(self) -> None:
        svc, runtime, engine, streams = (
            self.boot.svc,
            self.boot.runtime,
            self.engine,
            self.profile.max_streams,
        )
        limiter = ConcurrencyLimiter(f"{svc.name} streams", streams)
        servicer = TalkerServicer(self.new_session, svc.talker, limiter, svc.name)
        runtime.add_servicer(talker_pb2_grpc.add_TalkerServicer_to_server, servicer, "omnistage.v1.Talker")
        runtime.set_limits_provider(
            lambda: control_pb2.Limits(max_running_requests=streams, max_message_bytes=svc.max_message_bytes)
        )
        runtime.set_load_provider(lambda: (limiter.in_use, engine.jobs_queued))
        export_engine_gauges(engine, svc.name)
        export_queue_time(engine, svc.name)

    def memory_report(self) -> control_pb2.MemoryReport:
        return self.profile.memory_report(
            self.boot.mem, self.models.weights_bytes, self.runner.cache_bytes, self.graph_pool_bytes
        )


def main() -> None:
    run_stage(sys.argv[1:], "talker", TalkerStartup)


if __name__ == "__main__":
    main()
