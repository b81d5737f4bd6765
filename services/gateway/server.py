"""OmniServicer: validate, run the request through the stages, stream events back.

The gateway holds no model. It turns a public request into stage calls (the encoder for media parts,
then the thinker, and the talker for speech: speech.py), passes the client's remaining deadline to
each, and cancels the stage streams when the client goes away. Embeddings go from the encoder to the
thinker as TensorRefs, never through the gateway's memory; refs that never reach the thinker are
released here (media.py). Omni.Converse runs in converse.py.
"""

from __future__ import annotations

import time

import grpc
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.gateway.converse import Conversation, ConverseLimits
from omnistage.services.gateway.media import MediaStage, thinker_items
from omnistage.services.gateway.media_path import check_media_paths
from omnistage.services.gateway.speech import SpeechStage, voice_choice
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.validation import PlannedRequest, RequestLimits, plan_request
from omnistage.v1 import encoder_pb2, omni_pb2, omni_pb2_grpc, thinker_pb2


def _event(request_id: str, ev: thinker_pb2.ThinkerEvent) -> omni_pb2.GenerateEvent | None:
    """The client's event for a thinker event (with the client's request_id); None for `started`,
    whose engine id stays inside (the gateway aborts by cancelling the stage stream)."""
    kind = ev.WhichOneof("event")
    if kind == "started":
        return None
    if kind == "delta":
        d = ev.delta
        return omni_pb2.GenerateEvent(
            request_id=request_id,
            text=omni_pb2.TextDelta(text=d.text, token_ids=d.token_ids, logprobs=d.logprobs),
        )
    f = ev.finish
    return omni_pb2.GenerateEvent(
        request_id=request_id, finish=omni_pb2.Finish(reason=f.reason, usage=f.usage, message=f.message)
    )


class OmniServicer(omni_pb2_grpc.OmniServicer):
    """The public API; one short method per RPC."""

    def __init__(
        self,
        thinker: ThinkerClient | None,
        deployed: set[str],
        *,
        max_concurrent_requests: int,
        limits: RequestLimits,
        system_prompt: str,
        media_dir: str = "",
        media: MediaStage | None = None,
        speech: SpeechStage | None = None,
        converse: ConverseLimits = ConverseLimits(),
    ) -> None:
        self.thinker = thinker
        self.media = media  # None: no encoder (media parts get FAILED_PRECONDITION)
        self.speech = speech  # None: no talker (MODALITY_AUDIO and Converse get FAILED_PRECONDITION)
        self.converse = converse
        self.deployed = deployed
        self.max_concurrent_requests = max_concurrent_requests
        self.limits = limits
        self.system_prompt = system_prompt
        self.media_dir = media_dir
        self.in_flight = 0

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived_at = time.monotonic()
        paths = check_media_paths(request, self.media_dir)  # a file path is a permission question, asked first
        plan = plan_request(request, self.deployed, self.system_prompt, self.limits)
        spoken = omni_pb2.MODALITY_AUDIO in plan.outputs
        choice = voice_choice(request) if spoken else None
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        if plan.media and self.media is None:
            raise StageUnavailable(
                f"{plan.media[0].where}: the 'encoder' stage is not available (gateway started degraded)"
            )
        if spoken and self.speech is None:
            raise StageUnavailable("output_modalities: the 'talker' stage is not available", retryable=False)
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"gateway at its limit of {self.max_concurrent_requests} requests", retry_after_ms=200)
        self.in_flight += 1
        try:
            encoded: list[encoder_pb2.EncodedItem] = []
            if plan.media:
                encoded = await self.media.encode(plan.request_id, plan.media, paths, context.time_remaining())
            handed_over = False  # the thinker's `started`: from then on the leases are its business
            events = self._thinker_events(plan, encoded, context)
            if spoken:
                events = self.speech.answer(plan.request_id, choice, events, context.time_remaining(), arrived_at)
            try:
                async for event in events:
                    if event is None:
                        handed_over = True
                    else:
                        yield event
            finally:
                await events.aclose()  # cancels the thinker stream now if the client left
                if encoded and not handed_over:
                    self.media.release(encoded)
        finally:
            self.in_flight -= 1

    async def _thinker_events(self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem], context):
        """The client's events of the thinker stream; None marks `started` (the thinker has the rows)."""
        self._check_media_tokens(plan, encoded)
        finished = False
        stream = self.thinker.generate(
            plan.request_id, plan.chat(encoded), plan.sampling, context.time_remaining(),
            multimodal=thinker_items(encoded),
        )  # fmt: skip
        try:
            async for ev in stream:
                yield _event(plan.request_id, ev)
                if ev.WhichOneof("event") == "finish":
                    finished = True
                    break
        except grpc.aio.AioRpcError as exc:
            raise self.thinker.error(exc) from exc
        finally:
            await stream.aclose()
        if not finished:
            raise StageUnavailable("thinker: stream ended without a finish event")

    def _check_media_tokens(self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem]) -> None:
        """Media alone longer than the thinker's context: refused here, before the thinker is called."""
        limit = self.limits.max_model_len
        tokens = sum(item.num_tokens for item in encoded)
        if limit and tokens >= limit:
            raise InvalidRequest(
                f"messages: the media parts take {tokens} prompt tokens, the thinker's max_model_len is {limit}"
            )

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        conversation = Conversation(self, context)
        config = await conversation.open(request_iterator)  # checks before the call counts as in flight
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"gateway at its limit of {self.max_concurrent_requests} requests", retry_after_ms=200)
        self.in_flight += 1
        try:
            async for event in conversation.run(config):
                yield event
        finally:
            self.in_flight -= 1
