"""`python -m omnistage.services.talker --config F --service NAME`: the talker (text to speech) stage.

Start-up phases (common/runtime/boot.py): loading_weights (talker shards, the VAE, CAM++, then the
preset voices encoded once) → profiling_memory (stress-and-cap of the step batch, then the streams
whose caches fit the budget beside it, built and measured, step graphs captured; a plain CPU takes
the largest step batch without a stress run) → warming_up (one sentence through the whole Speak path)
→ serving `omnistage.v1.Talker`. CPU or one GPU (`gpus[0]`).
"""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

from omnistage.common.log import get_logger
from omnistage.common.memory.units import fmt_bytes
from omnistage.common.runtime.boot import StageStartup, run_stage
from omnistage.services.talker import startup
from omnistage.services.talker.metrics import StepMetrics, export_engine_gauges, queue_time_hook
from omnistage.services.talker.models.config import TALKER_DIR
from omnistage.services.talker.models.loader import load_talker
from omnistage.services.talker.request_flow import TalkerEngine
from omnistage.services.talker.server import TalkerServicer
from omnistage.services.talker.speaker import SpeakerEncoder
from omnistage.services.talker.voices import VoiceBank
from omnistage.v1 import control_pb2, talker_pb2_grpc

log = get_logger(__name__)


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
            self.models, b.mem, tcfg, b.allocator_budget, b.progress.in_phase, self.speaker.dim, b.full_warmup
        )
        self.runner, self.graph_pool_bytes = startup.build_runner(
            self.models, b.mem, tcfg, self.profile, b.allocator_budget, b.progress.in_phase, self.speaker.dim
        )

    async def warm_up(self) -> None:
        svc, runtime = self.boot.svc, self.boot.runtime
        self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix=f"{svc.name}-clip")
        self.engine = TalkerEngine(
            self.runner,
            self.voices,
            svc.talker,
            self.pool,
            service=svc.name,
            on_step=StepMetrics(svc.name),
            on_failure=lambda exc: runtime.fail(str(exc)),
        )
        self.engine.start()
        runtime.add_shutdown_hook(lambda: self.pool.shutdown(wait=False, cancel_futures=True))
        runtime.add_shutdown_hook(self.engine.stop)
        await startup.warm_up(self.engine, self.boot.full_warmup)

    def serve(self) -> None:
        svc, runtime, engine = self.boot.svc, self.boot.runtime, self.engine
        runtime.add_servicer(
            talker_pb2_grpc.add_TalkerServicer_to_server,
            TalkerServicer(engine, svc.talker),
            "omnistage.v1.Talker",
        )
        limits = control_pb2.Limits(
            max_running_requests=engine.max_streams,
            max_step_batch=engine.step_batch,
            realtime_lead_ms=round(svc.talker.realtime_lead_s * 1000),
            max_message_bytes=svc.max_message_bytes,
        )
        runtime.set_limits_provider(lambda: limits)
        runtime.set_load_provider(lambda: (engine.streams.in_use, engine.jobs_queued))
        export_engine_gauges(
            svc.name, lambda: engine.jobs_in_flight, lambda: engine.streams.in_use, engine.max_streams
        )
        engine.on_admit = queue_time_hook(svc.name)
        log.info(
            "talker: %d streams (%s of caches each), steps of at most %d",
            engine.max_streams,
            fmt_bytes(self.profile.stream_bytes),
            engine.step_batch,
        )

    def memory_report(self) -> control_pb2.MemoryReport:
        return self.profile.memory_report(
            self.boot.mem, self.models.weights_bytes, self.runner.cache_bytes, self.graph_pool_bytes
        )


def main() -> None:
    run_stage(sys.argv[1:], "talker", TalkerStartup)


if __name__ == "__main__":
    main()
