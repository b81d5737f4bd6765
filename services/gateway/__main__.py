"""`python -m omnistage.services.gateway --config F --service NAME`: the public Omni API."""

from __future__ import annotations

import sys

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.memory.report import export_host_memory
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.services.gateway.converse import ConverseLimits
from omnistage.services.gateway.encode_cache import EncodeCache
from omnistage.services.gateway.media import MESSAGE_OVERHEAD
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.startup import Stages, build_pipeline, request_limits
from omnistage.services.gateway.validation import public_receive_bytes, wire_bounds
from omnistage.v1 import control_pb2, omni_pb2_grpc


def _converse_limits(cfg: DeployConfig, svc: ServiceConfig) -> ConverseLimits:
    gw, encoders = svc.gateway, cfg.services_of("encoder")
    enc = encoders[0].encoder if encoders else None
    return ConverseLimits(
        gw.converse_max_turns,
        gw.converse_max_turn_chars,
        gw.converse_max_turn_audio_bytes,
        enc.max_audio_seconds if enc else ConverseLimits.max_audio_seconds,
        enc.max_items_per_request if enc else ConverseLimits.max_audio_items,
    )


def _serve_omni(runtime: ServiceRuntime, svc: ServiceConfig, servicer: OmniServicer, stages: Stages) -> None:
    """The Omni service on the runtime's port, with what Describe and the load reports read."""
    gw, pipeline = svc.gateway, servicer.pipeline
    runtime.set_readiness_provider(stages.readiness)
    runtime.add_servicer(
        omni_pb2_grpc.add_OmniServicer_to_server,
        servicer,
        "omnistage.v1.Omni",
        bounds=wire_bounds(pipeline.limits),
    )
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=gw.max_concurrent_requests, max_message_bytes=svc.max_message_bytes
        )
    )
    runtime.set_load_provider(lambda: (pipeline.in_flight, pipeline.thinker_gate.waiting))


async def _wait_for_thinker(runtime: ServiceRuntime, svc: ServiceConfig, stages: Stages) -> None:
    """Text first: the gateway turns SERVING as soon as the thinker is admitted (SERVING + a warm-up
    through the path clients take), bounded by gateway.stage_wait_s; the other stages join as their
    watches admit them (health names omnistage.v1.Omni.<capability>, Describe.readiness).
    `omnistage serve` calls the pipeline ready when every capability is (common/launcher/)."""
    gw, thinker = svc.gateway, stages.pipeline.thinker
    runtime.reporter.enter("warming_up", total=1, unit="stages")
    watch = stages.watches.get(thinker.name) if thinker is not None else None
    if watch is None:
        return
    runtime.reporter.heartbeat(f"waiting for {watch.client.name}")
    if not await watch.wait_admitted(gw.stage_wait_s) and not gw.allow_degraded:
        raise StageUnavailable(
            f"stage '{watch.client.name}' not admitted after {gw.stage_wait_s:g}s "
            f"(gateway.stage_wait_s): {watch.client.down_reason}"
        )
    runtime.reporter.advance()


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    servicer = OmniServicer(build_pipeline(runtime, cfg, svc), _converse_limits(cfg, svc))
    stages = Stages(runtime, svc.gateway, servicer)
    _serve_omni(runtime, svc, servicer, stages)
    export_host_memory(svc.name)  # no device: its host memory in the ledger's metrics
    stages.start()
    await _wait_for_thinker(runtime, svc, stages)
    if svc.gateway.http_port:
        capabilities = tuple(r.capability for r in stages.readiness())
        await _start_http_front(runtime, cfg, svc, capabilities, servicer.pipeline.kept)
    runtime.set_serving()


async def _start_http_front(
    runtime: ServiceRuntime,
    cfg: DeployConfig,
    svc: ServiceConfig,
    capabilities: tuple[str, ...],
    kept: EncodeCache | None,
) -> None:
    """The OpenAI-compatible HTTP front (gateway.http_port), calling this gateway's own Omni port (and,
    in process, its encode cache: Realtime turns encoded ahead)."""
    from omnistage.services.gateway.openai.serve import HttpFront

    front = HttpFront(cfg, svc, runtime.port, capabilities, kept)
    await front.start()
    runtime.add_shutdown_hook(front.stop)


def _receive_bytes(cfg: DeployConfig, svc: ServiceConfig) -> int:
    """The public API's gRPC receive limit: the largest request a legitimate client can send this
    deployment (media only with an encoder, a custom voice only with a talker)."""
    encoders, talkers = cfg.services_of("encoder"), cfg.services_of("talker")
    return public_receive_bytes(
        request_limits(svc),
        encoders[0].max_message_bytes - MESSAGE_OVERHEAD if encoders else 0,
        talkers[0].max_message_bytes if talkers else 0,
    )


def main() -> None:
    run_service(sys.argv[1:], "gateway", build, receive_bytes=_receive_bytes)


if __name__ == "__main__":
    main()
