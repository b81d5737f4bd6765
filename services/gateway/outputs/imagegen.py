"""The image stage as an output stage (MODALITY_IMAGE): after the answer, the thinker's hidden states at
the image query slots → ImageGen's progress and PNG, then the Finish.

Admission: the `imagegen` gate, sized by `ImageLimits.gate` summed over the replicas that are up. Each
request denoises on the least loaded replica that is up (replicas.py) unless pinned to one (a replica's
own warm-up). Leases: the hidden states are leased from the thinker's pool; ImageGen copies them and
ends the lease before its first event; a ref the gateway never forwards is released here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
from omnistage.common.config import DeployConfig, ImageGenConfig, ServiceConfig
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.transport import TransportContext
from omnistage.common.transport.release import release_quietly
from omnistage.services.gateway.outputs import OutputStage, Startup
from omnistage.services.gateway.outputs.image_options import (
    MESSAGE_OVERHEAD,
    STAGE,
    ImageLimits,
    ImagePlan,
    edit_size,
    image_size,
    plan_image,
    public_details,
)
from omnistage.services.gateway.replicas import Replicas, in_flight_share
from omnistage.services.gateway.stages import ImageGenClient, StageError, broken_stream
from omnistage.services.gateway.validation import PlannedRequest
from omnistage.v1 import common_pb2, omni_pb2, tensor_pb2, thinker_pb2

_image_load = in_flight_share(lambda c: c.max_running)


class ImageStage(OutputStage):
    """The gateway's side of the image stage: options, the ImageGen call, lease releases."""

    kind = STAGE
    client_class = ImageGenClient
    after_answer = True
    thinker_calls = 1  # the hidden states read the request's media too

    def __init__(
        self,
        client: ImageGenClient | Sequence[ImageGenClient],
        transport: TransportContext,
        limits: ImageLimits,
        *,
        allow_cuda_ipc: bool = False,
        service: str | None = None,
        configs: dict[str, ImageGenConfig] | None = None,
    ) -> None:
        self.replicas = Replicas(STAGE, [client] if isinstance(client, ImageGenClient) else client, service)
        self.client = self.replicas.first
        self._pinned: dict[str, ImageGenClient] = {}  # request id → the replica it must use (warm-ups)
        self.transport = transport  # releases only: the gateway maps no bytes of the thinker's refs
        self.limits = limits
        self.configs = configs or {}  # each replica's deploy-file section (its limits without Describe)
        # ImageGen runs on a GPU: hidden states made on the thinker's GPU may stay there (CUDA IPC).
        self.allow_cuda_ipc = allow_cuda_ipc

    @classmethod
    def from_deploy(
        cls, cfg: DeployConfig, svc: ServiceConfig, clients: Sequence[ImageGenClient]
    ) -> ImageStage:
        """The replicas with the deploy file's limits (their Describe's, once admitted). Releases only
        (hidden states that never reach ImageGen): the gateway maps no bytes of them. A GPU image stage
        can open CUDA IPC handles, so hidden states made on a GPU may stay there."""
        replicas = cfg.services_of(STAGE)
        return cls(
            clients,
            TransportContext(),
            ImageLimits.of(replicas[0].imagegen, None),
            allow_cuda_ipc=all(r.device == "cuda" for r in replicas),
            service=svc.name,
            configs={r.name: r.imagegen for r in replicas},
        )

    def plan(self, request: omni_pb2.GenerateRequest, planned: PlannedRequest) -> ImagePlan:
        return plan_image(request, planned, self.limits)

    def hidden_states_request(self) -> thinker_pb2.HiddenStatesRequest:
        return thinker_pb2.HiddenStatesRequest(allow_cuda_ipc=self.allow_cuda_ipc)

    async def after(
        self, answer: Any, image: ImagePlan, finish: omni_pb2.GenerateEvent
    ) -> omni_pb2.GenerateEvent:
        """The image: hidden states of the conversation's query block (the thinker again, with the media
        encoded for the answer) in a slot of the `imagegen` gate, then ImageGen's progress and PNG; the
        answer's Finish with the hidden-state call's prompt added to its usage."""
        usage = finish.finish.usage
        reference = await self.reference_bytes(image, answer.media.paths)
        states: list[thinker_pb2.HiddenStates] = []
        forwarded: list[bool] = []  # ImageGen answered: it has read (and released) the condition
        async with answer.ticket.slot(STAGE, answer.remaining()):
            try:
                done = await answer.hidden_states(self.hidden_states_request(), states)
                usage.prompt_tokens += done.usage.prompt_tokens
                usage.cached_prompt_tokens += done.usage.cached_prompt_tokens
                if not states:
                    reason = common_pb2.FinishReason.Name(done.reason)
                    raise StageUnavailable(
                        f"thinker: the hidden-state request ended ({reason}) without hidden states"
                    )
                await self._denoise(answer, image, states[-1].tensor, reference, forwarded)
            finally:
                if states and not forwarded:
                    self.release([s.tensor for s in states])
        return finish

    async def _denoise(
        self,
        answer: Any,
        image: ImagePlan,
        condition: tensor_pb2.TensorRef,
        reference: bytes,
        forwarded: list,
    ) -> None:
        """Stream ImageGen with the client's remaining deadline: a progress event per denoising step,
        then the image (another replica when one is found unreachable before it began)."""
        request_id, run = answer.request.request_id, answer.run
        size = (image.width, image.height)
        if image.reference is not None and 0 in size:
            default = edit_size(*image_size(reference, image.reference.where), self.limits)
            size = (size[0] or default[0], size[1] or default[1])
        request = image.request(request_id, condition, reference, image.prompt_text, size)
        for _ in range(len(self.replicas)):
            client = self.replica_for(request_id)
            try:
                async with contextlib.aclosing(client.generate(request, answer.remaining())) as events:
                    async for ev in events:
                        forwarded.append(True)
                        if ev.WhichOneof("event") == "image":
                            im = ev.image
                            result = omni_pb2.ImageResult(png=im.png, width=im.width, height=im.height)
                            await run.emit(omni_pb2.GenerateEvent(request_id=request_id, image=result))
                            return
                        p = omni_pb2.Progress(
                            stage=STAGE, done=ev.progress.step, total=ev.progress.total_steps
                        )
                        await run.emit(omni_pb2.GenerateEvent(request_id=request_id, progress=p))
            except grpc.aio.AioRpcError as exc:
                if not self._next_replica(client, exc, bool(forwarded)):
                    name = STAGE if len(self.replicas) == 1 else client.name  # a replica is named
                    raise StageError(name, exc, public_details(exc.details() or "", image)) from exc
                continue
            raise RuntimeError(f"{STAGE}: the stream ended without an image")
        raise self.replicas.unavailable()

    def _next_replica(self, client: ImageGenClient, exc: grpc.aio.AioRpcError, began: bool) -> bool:
        """A failed call: True when another replica should take the request (this one was found
        unreachable before it began it); raises UNAVAILABLE when it went down under the call."""
        if not client.up:  # went down under the call (its StageWatch)
            raise client.unavailable() from exc
        if exc.code() == grpc.StatusCode.UNAVAILABLE or broken_stream(exc):
            client.unreachable(exc.details() or "")  # its watch takes it out now
            return not began and not client.up and bool(self.replicas.up())
        return False

    async def reference_bytes(self, image: ImagePlan, paths: dict[str, Path]) -> bytes:
        """The edited part's bytes (read from `gateway.media_dir` for a path); b"" without an edit."""
        part = image.reference
        if part is None:
            return b""
        if part.media.WhichOneof("source") == "data":
            return part.media.data
        where = f"{part.where}.path"
        limit = self.client.max_message_bytes - MESSAGE_OVERHEAD
        size = paths[where].stat().st_size
        if size > limit:
            raise InvalidRequest(
                f"{where}: the image to edit has {size} bytes, more than the {limit} one image-stage request takes"
            )
        return await asyncio.to_thread(paths[where].read_bytes)

    def release(self, refs: Sequence[tensor_pb2.TensorRef]) -> None:
        """End the leases of hidden-state refs that will not reach ImageGen (a second release is a no-op)."""
        for ref in refs:
            release_quietly(self.transport, ref, "hidden-state lease")  # the thinker may be gone

    def replica_for(self, request_id: str) -> ImageGenClient:
        """The replica this request denoises on: its pinned one, else the least loaded one that is up
        (UNAVAILABLE naming every replica when none is)."""
        client = self._pinned.get(request_id) or self.replicas.pick(_image_load)
        if client is None:
            raise self.replicas.unavailable()
        return client

    @contextlib.contextmanager
    def pinned(self, request_id: str, client: ImageGenClient) -> Iterator[None]:
        """Within the block, request `request_id` denoises on `client` (a replica's own warm-up)."""
        self._pinned[request_id] = client
        try:
            yield
        finally:
            self._pinned.pop(request_id, None)

    def capacity(self) -> tuple[int, int]:
        """(running, waiting) the replicas that are up take at once: the `imagegen` gate's size. A replica
        whose limits are not read yet counts for what the first one read; none up: the first one's."""
        known = next((c for c in self.replicas.clients if c.max_running), None)
        if known is None:
            gate = self.limits.gate()
            return gate.max_running, gate.max_waiting
        up = self.replicas.up() or [known]
        return (
            sum(c.max_running or known.max_running for c in up),
            sum(c.max_waiting or known.max_waiting for c in up),
        )

    async def on_up(self, client: ImageGenClient, startup: Startup) -> None:
        """Its limits (Describe; the deploy file's without an admin port), then a warm-up image."""
        await startup.needs_thinker("the image warm-up")
        desc = await client.describe()
        self.limits = ImageLimits.of(
            self.configs.get(client.name, ImageGenConfig()), desc.limits if desc is not None else None
        )
        gate = self.limits.gate()
        client.max_running, client.max_waiting = gate.max_running, gate.max_waiting
        try:
            await startup.through(client, self._warm_up(client, startup))
        finally:
            startup.resize()

    async def _warm_up(self, client: ImageGenClient, startup: Startup) -> None:
        """One image request through the path clients take (thinker hidden states → this replica), one
        step at the smallest size."""
        startup.resize()  # with this replica counted: its warm-up takes a slot of the gate
        side = self.limits.min_side_px
        request = omni_pb2.GenerateRequest(
            request_id=f"gateway-warmup-image-{client.name}",
            output_modalities=[omni_pb2.MODALITY_IMAGE],
            messages=[
                omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="warm-up")])
            ],
            image=omni_pb2.ImageOptions(width=side, height=side, steps=1, seed=0),
        )
        with self.pinned(request.request_id, client):
            events = await startup.generate(request, 120.0)
        kinds = [e.WhichOneof("event") for e in events]
        if kinds[-2:] != ["image", "finish"]:
            raise RuntimeError(
                f"the image warm-up request ended with {kinds[-2:]}, not an image and a finish"
            )

    async def close(self) -> None:
        await super().close()
        self.transport.close()


OUTPUT_STAGE = ImageStage
