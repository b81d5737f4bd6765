"""`python -m omnistage.services.thinker --config F --service NAME --rank R`: one thinker rank.

Start-up phases (common/runtime/boot.py, every rank; the TP group agrees on each step through
`RankStartup`, its StageGroup): loading_weights (the rendezvous, the tokenizer on rank 0, the rank's
shards) → profiling_memory (the KV auto-profile) → warming_up (every dummy shape on every rank, a
plain CPU's minimal ones; rank 0 starts the grammar compile server beside it, where
engine.grammar_server has it start at start-up) → capturing_graphs (CUDA
decode graphs, when on) → the group agrees it has started → rank 0 sends one real request through the
engine and serves `omnistage.v1.Thinker`; ranks 1..N-1 run rank 0's plans.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

from omnistage.common.runtime.blocking import in_daemon_thread
from omnistage.common.runtime.boot import Boot, StageStartup, run_stage
from omnistage.common.runtime.device_loop import DeviceFailed
from omnistage.common.transport import TransportContext
from omnistage.services.thinker import startup
from omnistage.services.thinker.engine.grammar_compiles import (
    GrammarCompiles,
    GrammarLimits,
    server_at_startup,
)
from omnistage.services.thinker.engine_metrics import EngineMetrics
from omnistage.services.thinker.group.startup import RankConfig, RankStartup, StartedRank, rank0_engine
from omnistage.services.thinker.group.worker import run_plan_loop
from omnistage.services.thinker.image_queries import load_image_queries
from omnistage.services.thinker.multimodal import MediaInputs
from omnistage.services.thinker.request_flow import ThinkerEngine
from omnistage.services.thinker.server import ThinkerServicer
from omnistage.services.thinker.tp.distributed import TPError
from omnistage.v1 import control_pb2, thinker_pb2_grpc


class ThinkerStartup(StageStartup):
    """One rank through the common boot; its steps and its group's hooks are the rank's `RankStartup`."""

    caps_allocator = False  # the KV auto-profile sizes the rank within its budget

    def __init__(self, boot: Boot) -> None:
        super().__init__(boot)
        cfg = RankConfig.from_deploy(boot.cfg, boot.svc, boot.rank)
        accounted = boot.on_cuda or bool(boot.svc.memory.simulated_capacity_bytes)
        self.rank = RankStartup(cfg, boot.progress, boot.mem if accounted else None)
        self.group = self.rank
        self.load_unit, self.warm_up_unit = cfg.load_unit, "shapes"
        self.flow: ThinkerEngine | None = None
        self.grammars: GrammarCompiles | None = None  # rank 0's, started beside the warm-up
        self.grammars_started: asyncio.Future[None] | None = None

    def meter(self) -> contextlib.AbstractContextManager[object]:
        return self.rank.meter()

    def load(self) -> None:
        self.rank.load()

    def stress(self) -> None:
        self.rank.profile()

    async def warm_up(self) -> None:
        if self.boot.rank == 0:
            self._grammars(start=server_at_startup(self.boot.svc.engine.grammar_server, self.boot.on_cuda))

        def shapes_and_graphs() -> None:
            with self.rank.meter():
                self.rank.warm_up()
                if self.rank.graphs:
                    if self.grammars is not None and self.grammars_started is not None:
                        self.grammars.start()  # waits for the start in flight: a capture runs alone
                    self.enter("capturing_graphs", unit="graphs")
                    self.rank.capture_graphs()

        await in_daemon_thread(shapes_and_graphs, "thinker-blocking")

    def _grammars(self, start: bool) -> None:
        """Rank 0: the structured outputs' compiles. With `start` (engine.grammar_server), the compile
        server and the tokenizer's grammar info start in a thread beside the warm-up (awaited before
        SERVING). Seconds of Python on a real vocabulary: at start-up, not at the first structured
        request (it held the GIL and stalled every stream); the server loads xgrammar meanwhile, in
        parallel. Without, the first constrained request starts them."""
        e, tokenizer = self.boot.svc.engine, self.rank.tokenizer
        assert tokenizer is not None, "rank 0 loads the tokenizer first"
        limits = GrammarLimits(e.grammar_compile_timeout_s, e.grammar_compiles, e.grammar_waiting)
        self.grammars = GrammarCompiles(tokenizer, asyncio.get_running_loop(), limits)
        self.boot.runtime.add_shutdown_hook(
            self.grammars.close
        )  # needs no group: after control.close is fine
        if start:
            self.grammars_started = in_daemon_thread(self.grammars.start, "thinker-grammars")

    async def warm_up_request(self) -> None:
        """Rank 0: the engine, its media and hidden-state pools, one real request through it, the flow."""
        self.started: StartedRank = self.rank.result()
        if self.boot.rank == 0:
            self.flow = await self._start_flow(self.started)

    def serve(self) -> None:
        if self.flow is None:  # a worker: no API of its own
            return
        flow, svc, runtime, rcfg = self.flow, self.boot.svc, self.boot.runtime, self.started.runner.cfg
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
                decode_step_times=[t.to_proto() for t in self.started.decode_steps],
            )
        )
        runtime.set_load_provider(flow.load)
        # The runtime drains in-flight RPCs first; only then does the engine stop (and release the ranks).
        runtime.add_shutdown_hook(flow.stop)

    def memory_report(self) -> control_pb2.MemoryReport:
        return self.started.runner.memory_report()

    async def run(self) -> None:
        """Ranks 1..N-1: rank 0's plans until the exit plan, then the service stops."""
        if self.boot.rank > 0:
            await in_daemon_thread(lambda: run_plan_loop(self.started), "thinker-blocking")
            self.boot.runtime.request_stop()

    async def _start_flow(self, started: StartedRank) -> ThinkerEngine:
        runtime, svc, control = self.boot.runtime, self.boot.svc, started.control
        # Registered before the flow's hooks, so it runs after them (only the grammar server's close,
        # registered at the warm-up, runs later): the store host stays until a failure has been read.
        runtime.add_shutdown_hook(control.close)
        engine = rank0_engine(started)
        model_config = engine.runner.model.config
        queries = load_image_queries(
            self.boot.checkpoint,
            model_config.hidden_size,
            engine.runner.dtype,
            self.boot.cfg.model.load_format,
        )
        # Consumer side of the encoder's embeddings: its shm pool mapped once, leases released here.
        media = MediaInputs(model_config, engine.runner.dtype, TransportContext(), queries)
        runtime.add_shutdown_hook(media.close)
        producer = startup.hidden_states_pool(queries, engine.cfg.max_num_seqs)
        if producer is not None:
            runtime.add_shutdown_hook(producer.close)
            startup.export_hidden_state_leases(runtime, svc.name, producer)
        runtime.reporter.progress(detail="one real request through the engine")
        try:
            await in_daemon_thread(lambda: startup.warm_up(engine, media), "thinker-blocking")
        except Exception as exc:
            raise TPError(startup.group_failure(control, "the warm-up request", exc)) from exc
        assert self.grammars is not None
        if self.grammars_started is not None:
            runtime.reporter.progress(detail="the grammar compile server and the tokenizer's grammar info")
            await self.grammars_started
        grammars = self.grammars
        engine.stats = EngineMetrics(svc.name, engine)  # after the warm-up: it counts clients' requests only
        flow = ThinkerEngine(
            engine, asyncio.get_running_loop(), media=media, producer=producer, grammars=grammars
        )
        # A peer's failure may come while the engine thread is blocked inside a collective: the
        # requests are failed from the thread that learns of it.
        control.add_failure_listener(lambda failure: flow.loop.fail(DeviceFailed(failure.message)))

        def on_engine_failure(error: DeviceFailed) -> None:
            failure = startup.group_failure(control, "serving", error.cause or error)
            runtime.fail(failure.message, failure.rank)

        flow.loop.on_failure.append(on_engine_failure)
        flow.start()
        runtime.add_shutdown_hook(flow.close)  # its tokenize pool
        return flow


def main() -> None:
    run_stage(sys.argv[1:], "thinker", ThinkerStartup)


if __name__ == "__main__":
    main()
