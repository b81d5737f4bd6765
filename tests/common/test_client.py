"""The Python client (sync and asyncio) against a fake gateway: the request, the API key and the
deadline reach the server, and the answer's events gather into one Result."""

from __future__ import annotations

import asyncio

import grpc
from omnistage.common.client import AsyncOmniClient, OmniClient
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc


class FakeOmni(omni_pb2_grpc.OmniServicer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    async def Generate(self, request, context):
        keys = dict(context.invocation_metadata())
        self.seen.append(
            (
                request.messages[-1].parts[0].text,
                keys.get("authorization", ""),
                context.time_remaining() is not None,
            )
        )
        yield omni_pb2.GenerateEvent(request_id="r1", text=omni_pb2.TextDelta(text="Hel"))
        yield omni_pb2.GenerateEvent(audio=omni_pb2.AudioChunk(pcm16=b"\x01\x00", sample_rate_hz=16000))
        yield omni_pb2.GenerateEvent(text=omni_pb2.TextDelta(text="lo"))
        yield omni_pb2.GenerateEvent(finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP))


async def _serve(fake: FakeOmni) -> tuple[grpc.aio.Server, str]:
    server = grpc.aio.server()
    omni_pb2_grpc.add_OmniServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


def _check(result, fake: FakeOmni) -> None:
    assert (result.text, result.pcm16, result.sample_rate_hz, result.request_id) == (
        "Hello",
        b"\x01\x00",
        16000,
        "r1",
    )
    assert result.ok and result.wav()[:4] == b"RIFF"
    assert fake.seen == [("Hi", "Bearer k1", True)]


def test_the_async_client_sends_the_key_and_gathers_the_answer():
    async def main() -> None:
        fake = FakeOmni()
        server, address = await _serve(fake)
        try:
            async with AsyncOmniClient(address, api_key="k1", timeout_s=30) as client:
                _check(await client.generate("Hi").collect(), fake)
        finally:
            await server.stop(None)

    asyncio.run(main())


def test_the_sync_client_sends_the_key_and_gathers_the_answer():
    async def main() -> None:
        fake = FakeOmni()
        server, address = await _serve(fake)
        try:

            def call():
                with OmniClient(address, api_key="k1", timeout_s=30) as client:
                    return client.generate("Hi").collect()

            _check(await asyncio.to_thread(call), fake)
        finally:
            await server.stop(None)

    asyncio.run(main())
