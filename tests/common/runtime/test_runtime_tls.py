"""The gateway's main port with TLS (and mutual TLS); the admin port stays plaintext on loopback."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from omnistage.common.config import config_from_dict
from omnistage.common.runtime.server import ServiceRuntime
from omnistage.v1 import omni_pb2, omni_pb2_grpc

from tests.common.runtime.synthetic_stage import SyntheticOmni, free_port, self_signed

pytestmark = pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make a certificate"
)


def gateway(tmp_path: Path, **tls) -> ServiceRuntime:
    svc = {"kind": "gateway", "port": 1, "admin_port": free_port(), "tls": tls}
    cfg = config_from_dict({"services": {"front": svc}})
    return ServiceRuntime(cfg, cfg.service("front"), 0, run_dir=tmp_path, port=0)


async def generate(channel) -> list:
    msg = omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="n=1")])
    return [
        e
        async for e in omni_pb2_grpc.OmniStub(channel).Generate(
            omni_pb2.GenerateRequest(messages=[msg]), timeout=10
        )
    ]


async def serve(rt: ServiceRuntime) -> None:
    await rt.start()
    rt.add_servicer(omni_pb2_grpc.add_OmniServicer_to_server, SyntheticOmni(), "omnistage.v1.Omni")
    rt.set_serving()


async def stop(rt: ServiceRuntime) -> None:
    rt.request_stop()
    await asyncio.wait_for(rt.serve_until_stopped(), 10)


def test_tls_port_serves_tls_clients_only(tmp_path):
    cert, key = self_signed(tmp_path, "server")

    async def scenario():
        rt = gateway(tmp_path, cert_file=str(cert), key_file=str(key))
        await serve(rt)
        try:
            creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
            async with grpc.aio.secure_channel(rt.address, creds) as ch:
                assert (await generate(ch))[-1].WhichOneof("event") == "finish"
            async with grpc.aio.insecure_channel(rt.address) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await generate(ch)
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.insecure_channel(
                rt.admin_address
            ) as admin:  # the launcher checks health here
                reply = await health_pb2_grpc.HealthStub(admin).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await stop(rt)

    asyncio.run(scenario())


def test_mutual_tls_needs_a_client_certificate_signed_by_the_client_ca(tmp_path):
    cert, key = self_signed(tmp_path, "server")
    client_cert, client_key = self_signed(tmp_path, "client")
    stranger_cert, stranger_key = self_signed(tmp_path, "stranger")

    async def scenario():
        rt = gateway(tmp_path, cert_file=str(cert), key_file=str(key), client_ca_file=str(client_cert))
        await serve(rt)
        try:
            for chain, private, ok in (
                (client_cert, client_key, True),
                (stranger_cert, stranger_key, False),
                (None, None, False),
            ):
                creds = grpc.ssl_channel_credentials(
                    root_certificates=cert.read_bytes(),
                    private_key=private.read_bytes() if private else None,
                    certificate_chain=chain.read_bytes() if chain else None,
                )
                async with grpc.aio.secure_channel(rt.address, creds) as ch:
                    if ok:
                        assert (await generate(ch))[-1].WhichOneof("event") == "finish"
                    else:
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            await generate(ch)
                        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await stop(rt)

    asyncio.run(scenario())


def test_an_unreadable_certificate_fails_the_start_naming_the_key(tmp_path):
    async def scenario():
        rt = gateway(
            tmp_path, cert_file=str(tmp_path / "missing.pem"), key_file=str(tmp_path / "missing.key")
        )
        with pytest.raises(ValueError, match=r"services.front.tls.key_file: cannot read .*missing.key"):
            await rt.start()

    asyncio.run(scenario())
