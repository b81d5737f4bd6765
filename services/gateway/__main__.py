"""`python -m omnistage.services.gateway --config F --service NAME`: the public Omni API."""

from __future__ import annotations

import sys

from omnistage.common.config import DeployConfig, ServiceConfig
from omnistage.common.runtime import auth
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.common.runtime.stage_main import run_service
from omnistage.services.gateway.prompt import Turn, build_chat
from omnistage.services.gateway.server import OmniServicer
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.validation import RequestLimits
from omnistage.v1 import common_pb2, control_pb2, omni_pb2_grpc


async def build(runtime: ServiceRuntime, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> None:
    gw = svc.gateway
    deployed = {s.kind for s in cfg.services.values() if s.kind != "gateway"}
    thinker = None
    max_model_len: int | None = None
    thinkers = cfg.services_of("thinker")
    if thinkers:
        t = thinkers[0]
        client = ThinkerClient(t.name, cfg.address(t.name), max(t.max_message_bytes, svc.max_message_bytes),
                               admin_address=cfg.admin_address(t.name), admin_metadata=auth.admin_metadata(t))
        runtime.reporter.enter("warming_up", total=1, unit="stages", detail=f"waiting for {t.name}")
        try:
            await client.wait_serving(gw.stage_wait_s)
            desc = await client.describe()  # None without an admin port: then only the thinker checks lengths
            max_model_len = (desc.limits.max_model_len or None) if desc is not None else None
            # A real request end to end before SERVING: the path the clients will take works.
            warmup = build_chat([Turn("user", "warm-up")])
            async for _ in client.generate("gateway-warmup", warmup, common_pb2.SamplingParams(max_tokens=1), 60.0):
                pass
            thinker = client
        except Exception:
            if not gw.allow_degraded:
                raise
            runtime.reporter.heartbeat(f"{t.name} unavailable; serving degraded")
            deployed.discard("thinker")
        runtime.reporter.advance()
    servicer = OmniServicer(
        thinker,
        deployed,
        max_concurrent_requests=gw.max_concurrent_requests,
        limits=RequestLimits(gw.max_messages, gw.max_parts_per_message, gw.max_prompt_chars, max_model_len),
        system_prompt=gw.system_prompt,
        media_dir=gw.media_dir,
    )
    runtime.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, servicer, "omnistage.v1.Omni")
    runtime.set_limits_provider(
        lambda: control_pb2.Limits(
            max_running_requests=gw.max_concurrent_requests, max_message_bytes=svc.max_message_bytes
        )
    )
    runtime.set_load_provider(lambda: (servicer.in_flight, 0))
    if thinker is not None:
        runtime.add_shutdown_hook(thinker.close)
    runtime.set_serving()


def main() -> None:
    run_service(sys.argv[1:], "gateway", build)


if __name__ == "__main__":
    main()
