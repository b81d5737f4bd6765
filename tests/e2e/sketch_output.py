"""A fake output stage added the way a new one is (issue 41): this one adapter module (registered as
`omnistage.services.gateway.outputs.sketch`), its client, and a row of the stage table
(`SKETCH_ROW`). After the answer it asks its stage (an ImageGen-shaped service) for a "sketch" of the
user's last words: a progress event, then the image. Nothing else in the gateway knows of it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from omnistage.common.stages import Stage
from omnistage.services.gateway.outputs import OutputStage, Startup
from omnistage.services.gateway.replicas import Replicas
from omnistage.services.gateway.stages import StageClient
from omnistage.v1 import imagegen_pb2, imagegen_pb2_grpc, omni_pb2

SKETCH_ROW = Stage(
    "sketch", "tests.e2e.sketch_output", capability="sketch", needs=("thinker",), outputs=("image",)
)


class SketchClient(StageClient):
    """The sketch stage's call (ImageGen.Generate's shape): its events, bounded by the caller's deadline."""

    def __init__(self, name: str, address: str, max_message_bytes: int, **admin: Any) -> None:
        super().__init__(name, address, max_message_bytes, **admin)
        self.stub = imagegen_pb2_grpc.ImageGenStub(self.channel)

    def sketch(self, words: str, timeout_s: float | None) -> AsyncIterator[imagegen_pb2.ImageGenEvent]:
        request = imagegen_pb2.ImageGenRequest(prompt_text=words)
        return self.stream(lambda: self.stub.Generate(request, timeout=timeout_s), "image")


class SketchStage(OutputStage):
    kind = "sketch"
    client_class = SketchClient
    after_answer = True

    def __init__(self, clients: list[SketchClient]) -> None:
        self.replicas = Replicas("sketch", clients, "gw-sketch")

    def plan(self, request: omni_pb2.GenerateRequest, planned: Any) -> str:
        return " ".join(p for p in planned.turns[-1].parts() if isinstance(p, str))

    def capacity(self) -> tuple[int, int | None]:
        return len(self.replicas.up()), None

    async def on_up(self, client: SketchClient, startup: Startup) -> None:
        await startup.needs_thinker("the sketch warm-up")
        request = omni_pb2.GenerateRequest(
            request_id=f"warm-up-{client.name}",
            output_modalities=[omni_pb2.MODALITY_IMAGE],
            messages=[
                omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Warm up.")])
            ],
        )
        events = await startup.through(client, startup.generate(request, 60.0))
        if events[-1].WhichOneof("event") != "finish":
            raise RuntimeError("the sketch warm-up ended without a finish")

    async def after(self, answer: Any, words: str, finish: omni_pb2.GenerateEvent) -> omni_pb2.GenerateEvent:
        client = self.replicas.pick(lambda c: c.calls_in_flight)
        if client is None:
            raise self.replicas.unavailable()
        run = answer.run
        async with answer.ticket.slot(self.kind, answer.remaining()):
            async for ev in client.sketch(words, answer.remaining()):
                if ev.WhichOneof("event") == "progress":
                    progress = omni_pb2.Progress(
                        stage=self.kind, done=ev.progress.step, total=ev.progress.total_steps
                    )
                    await run.emit(omni_pb2.GenerateEvent(request_id=run.request_id, progress=progress))
                else:
                    image = omni_pb2.ImageResult(
                        png=ev.image.png, width=ev.image.width, height=ev.image.height
                    )
                    await run.emit(omni_pb2.GenerateEvent(request_id=run.request_id, image=image))
        return finish


OUTPUT_STAGE = SketchStage
