"""OmniServicer: validate, run the request through the stages, stream events back.

The gateway holds no model. It turns a public request into stage calls (the encoder for media parts,
then the thinker; for MODALITY_IMAGE the thinker in hidden-state mode, then the image stage:
imaging.py), passes the client's remaining deadline to each, and cancels the stage streams when the
client goes away. Embeddings go from the encoder to the thinker, and hidden states from the thinker
to the image stage, as TensorRefs, never through the gateway's memory; refs that never reach their
consumer are released here (media.py, imaging.py).

With MODALITY_TEXT and MODALITY_IMAGE both, the text answer streams first, then the image is made
from the same conversation (a second thinker call; its media encoded again, because the thinker
consumes the encoder's refs when it takes a request); one Finish ends the stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.gateway.imaging import ImagePlan, ImageStage
from omnistage.services.gateway.media import MediaStage, thinker_items
from omnistage.services.gateway.media_path import check_media_paths
from omnistage.services.gateway.stages import StageError, ThinkerClient
from omnistage.services.gateway.validation import PlannedRequest, RequestLimits, plan_request
from omnistage.v1 import common_pb2, encoder_pb2, omni_pb2, omni_pb2_grpc, thinker_pb2

# A text answer that ended so is followed by the image, when one is asked for too.
_COMPLETE = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH, common_pb2.FINISH_REASON_STOP_STRING)


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
        images: ImageStage | None = None,
    ) -> None:
        self.thinker = thinker
        self.media = media  # None: no encoder (media parts get FAILED_PRECONDITION)
        self.images = images  # None: no image stage (MODALITY_IMAGE gets FAILED_PRECONDITION)
        self.deployed = deployed
        self.max_concurrent_requests = max_concurrent_requests
        self.limits = limits
        self.system_prompt = system_prompt
        self.media_dir = media_dir
        self.in_flight = 0

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        paths = check_media_paths(request, self.media_dir)  # a file path is a permission question, asked first
        plan = plan_request(request, self.deployed, self.system_prompt, self.limits)
        image = self._plan_image(request, plan)
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        if plan.media and self.media is None:
            raise StageUnavailable(
                f"{plan.media[0].where}: the 'encoder' stage is not available (gateway started degraded)"
            )
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"gateway at its limit of {self.max_concurrent_requests} requests", retry_after_ms=200)
        if image is not None:
            self.images.admit()
        self.in_flight += 1
        try:
            finish: omni_pb2.GenerateEvent | None = None
            if image is None or omni_pb2.MODALITY_TEXT in plan.outputs:
                async with contextlib.aclosing(self._text_events(plan, paths, context)) as events:
                    async for event in events:  # closing cancels the thinker stream now if the client left
                        if event.WhichOneof("event") == "finish":
                            finish = event
                        else:
                            yield event
                if image is None or finish.finish.reason not in _COMPLETE:
                    yield finish
                    return
            usage = common_pb2.Usage()
            if finish is None:
                finish = omni_pb2.GenerateEvent(request_id=plan.request_id,
                                                finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP))  # fmt: skip
            else:
                usage.CopyFrom(finish.finish.usage)
            async with contextlib.aclosing(self._image_events(plan, image, paths, usage, context)) as events:
                async for event in events:
                    yield event
            finish.finish.usage.CopyFrom(usage)
            yield finish
        finally:
            self.in_flight -= 1
            if image is not None:
                self.images.done()

    def _plan_image(self, request: omni_pb2.GenerateRequest, plan: PlannedRequest) -> ImagePlan | None:
        """The checked image options of a MODALITY_IMAGE request; None without one."""
        if omni_pb2.MODALITY_IMAGE not in plan.outputs:
            return None
        if self.images is None:
            raise StageUnavailable(
                "output_modalities: MODALITY_IMAGE needs the 'imagegen' stage, which is not available "
                "(gateway started degraded)"
            )
        return self.images.plan(request, plan)

    async def _text_events(self, plan: PlannedRequest, paths: dict[str, Path], context) -> AsyncIterator:
        """The client's events of a text answer: deltas, then the thinker's finish."""
        async with contextlib.aclosing(self._thinker_events(plan, paths, context)) as events:
            async for ev in events:
                event = _event(plan.request_id, ev)
                if event is not None:
                    yield event

    async def _image_events(
        self, plan: PlannedRequest, image: ImagePlan, paths: dict[str, Path], usage: common_pb2.Usage, context
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The image: hidden states of the conversation's query block, then ImageGen's progress and PNG."""
        assert self.images is not None
        reference = await self.images.reference_bytes(image, paths)
        hidden = self._thinker_events(plan, paths, context, hidden_states=self.images.hidden_states_request())
        async with contextlib.aclosing(hidden) as thinker_events:
            events = self.images.events(plan.request_id, image, thinker_events, reference, usage,
                                        context.time_remaining)  # fmt: skip
            async with contextlib.aclosing(events) as image_events:
                async for event in image_events:
                    yield event

    async def _thinker_events(
        self, plan: PlannedRequest, paths: dict[str, Path], context,
        hidden_states: thinker_pb2.HiddenStatesRequest | None = None,
    ) -> AsyncIterator[thinker_pb2.ThinkerEvent]:
        """The request's media through the encoder, then the thinker's events up to its finish. The
        encoder's refs are the thinker's business once it answers `started`; refs of a call that never
        got that far (client gone, thinker unreachable or refusing, a check here) are released here."""
        encoded: list[encoder_pb2.EncodedItem] = []
        if plan.media:
            encoded = await self.media.encode(plan.request_id, plan.media, paths, context.time_remaining())
        handed_over = False
        try:
            self._check_media_tokens(plan, encoded)
            finished = False
            mode = {"hidden_states": hidden_states} if hidden_states is not None else {}
            stream = self.thinker.generate(
                plan.request_id, plan.chat(encoded), plan.sampling, context.time_remaining(),
                multimodal=thinker_items(encoded), **mode,
            )  # fmt: skip
            try:
                async for ev in stream:
                    kind = ev.WhichOneof("event")
                    handed_over = handed_over or kind == "started"
                    yield ev
                    if kind == "finish":
                        finished = True
                        break
            except grpc.aio.AioRpcError as exc:
                raise StageError("thinker", exc) from exc
            finally:
                await stream.aclose()  # cancels the thinker stream now if the client left
            if not finished:
                raise StageUnavailable("thinker: stream ended without a finish event")
        finally:
            if encoded and not handed_over:
                self.media.release(encoded)

    def _check_media_tokens(self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem]) -> None:
        """Media alone longer than the thinker's context: refused here, before the thinker is called."""
        limit = self.limits.max_model_len
        tokens = sum(item.num_tokens for item in encoded)
        if limit and tokens >= limit:
            raise InvalidRequest(
                f"messages: the media parts take {tokens} prompt tokens, the thinker's max_model_len is {limit}"
            )

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        raise StageUnavailable("Converse needs the 'talker' stage, which is not deployed", retryable=False)
        yield  # pragma: no cover - makes this an async generator (a streaming handler)
