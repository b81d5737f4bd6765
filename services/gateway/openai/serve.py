"""Run the OpenAI front under uvicorn inside the gateway's event loop (gateway.http_port).

The HTTP server binds the gateway's bind_host at http_port, with the gateway's TLS certificate when it
has one, and calls the gateway's own Omni port through a gRPC channel. uvicorn's signal handling is
left out: the gateway's runtime owns SIGTERM and stops this server from its shutdown hook.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import grpc
import uvicorn
from omnistage.common.config import DeployConfig, EncoderConfig, ServiceConfig, join_host_port
from omnistage.common.runtime import auth
from omnistage.common.runtime.deadlines import within
from omnistage.services.gateway.openai import vad
from omnistage.services.gateway.openai.app import Front, FrontOptions
from omnistage.services.gateway.openai.realtime import RealtimeEndpoint
from omnistage.services.gateway.openai.realtime_input import AheadCache
from omnistage.services.gateway.openai.realtime_limits import RealtimeOptions
from omnistage.v1 import omni_pb2_grpc

_log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers (the gateway's runtime owns SIGINT/SIGTERM)."""

    @contextlib.contextmanager
    def capture_signals(self):  # uvicorn >= 0.29
        yield

    def install_signal_handlers(self) -> None:  # older uvicorn
        pass


def _realtime_options(cfg: DeployConfig, svc: ServiceConfig) -> RealtimeOptions:
    """The gateway's realtime_* keys, the buffer capped by what one Converse turn may hold."""
    gw = svc.gateway
    encoders = cfg.services_of("encoder")  # the first one, as the Converse limits take it
    max_audio_s = encoders[0].encoder.max_audio_seconds if encoders else EncoderConfig.max_audio_seconds
    options = RealtimeOptions(
        gw.realtime_max_sessions,
        gw.realtime_max_sessions_per_key,
        gw.realtime_max_buffer_bytes,
        gw.realtime_max_session_s,
        gw.realtime_idle_timeout_s,
        gw.converse_max_turn_chars,
        gw.max_prompt_chars,
        gw.realtime_encode_ahead_ms,
    )
    return options.buffer_limit(gw.converse_max_turn_audio_bytes, max_audio_s)


def _omni_channel(cfg: DeployConfig, svc: ServiceConfig, grpc_port: int) -> grpc.aio.Channel:
    """The front's channel to the gateway's own Omni port (its TLS when it has one)."""
    target = join_host_port(cfg.dial_host(svc.bind_host), grpc_port)
    options = [
        ("grpc.max_receive_message_length", svc.max_message_bytes),
        ("grpc.max_send_message_length", svc.max_message_bytes),
    ]
    creds = auth.channel_credentials(svc)
    if creds is not None:
        return grpc.aio.secure_channel(target, creds, options)
    return grpc.aio.insecure_channel(target, options)


class HttpFront:
    """The running HTTP front: `start()` binds (OSError naming the key when it cannot), `stop()` ends it."""

    def __init__(
        self,
        cfg: DeployConfig,
        svc: ServiceConfig,
        grpc_port: int,
        capabilities: tuple[str, ...] = (),
        kept: AheadCache | None = None,
    ) -> None:
        """`kept`: the gateway's encode cache, which Realtime sessions encode their turns ahead into."""
        gw = svc.gateway
        self.svc = svc
        self.where = join_host_port(svc.bind_host, gw.http_port)
        self.channel = _omni_channel(cfg, svc, grpc_port)
        keys = auth.api_keys(svc)
        check_key = keys.refusal if keys is not None else None
        realtime = RealtimeEndpoint(
            omni_pb2_grpc.OmniStub(self.channel), _realtime_options(cfg, svc), gw.http_model, check_key, kept
        )
        self.front = front = Front(
            self.channel,
            FrontOptions(
                model=gw.http_model,
                timeout_s=gw.http_timeout_s,
                max_body_bytes=gw.http_max_body_bytes,
                allow_unknown_fields=gw.http_allow_unknown_fields,
                capabilities=capabilities,
            ),
            check_key=check_key,
            realtime=realtime,
        )
        ssl = {}
        if svc.tls is not None:
            ssl = {"ssl_certfile": svc.tls.cert_file, "ssl_keyfile": svc.tls.key_file}
            if svc.tls.client_ca_file:
                import ssl as ssl_mod

                ssl |= {"ssl_ca_certs": svc.tls.client_ca_file, "ssl_cert_reqs": ssl_mod.CERT_REQUIRED}
        config = uvicorn.Config(
            front.app(),
            log_config=None,
            access_log=False,
            lifespan="off",
            # /v1/realtime: uvicorn's implementation on the `websockets` package (its Sans-I/O protocol;
            # the legacy one is deprecated there); a message at most as large as an HTTP body.
            ws="websockets-sansio",
            ws_max_size=gw.http_max_body_bytes,
            timeout_graceful_shutdown=max(1, int(svc.drain_grace_s)),
            **ssl,
        )
        self.server = _Server(config)
        self.sock: socket.socket | None = None
        self.task: asyncio.Task | None = None

    async def start(self) -> int:
        """Bind and serve; the bound port."""
        family = socket.AF_INET6 if ":" in self.svc.bind_host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if os.name != "nt":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.svc.bind_host, self.svc.gateway.http_port))
            sock.listen(1024)
            sock.setblocking(False)
        except OSError as exc:
            sock.close()
            raise OSError(
                f"services.{self.svc.name}.gateway.http_port: cannot bind {self.where} (in use?): {exc}"
            ) from exc
        self.sock = sock
        await asyncio.to_thread(vad.warm_up)  # the VAD model loads now (and a missing one fails here)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]), name="openai-http")
        deadline = asyncio.get_running_loop().time() + 30
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError(f"{self.where}: the HTTP server stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{self.where}: the HTTP server did not start within 30 s")
            await asyncio.sleep(0.02)
        port = sock.getsockname()[1]
        _log.info(
            "OpenAI-compatible HTTP front at %s (%s)",
            join_host_port(self.svc.bind_host, port),
            "https" if self.svc.tls else "http",
        )
        return port

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            try:
                await within(self.task, max(2.0, self.svc.drain_grace_s + 2.0))
            except (TimeoutError, asyncio.CancelledError):
                self.task.cancel()
            except Exception:
                _log.exception("the HTTP front failed while stopping")
        self.front.close()
        await self.channel.close()
        if self.sock is not None:
            self.sock.close()
