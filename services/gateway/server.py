"""OmniServicer: validate, run the request through the stages, stream events back.

The gateway holds no model. It turns a public request into stage calls (the encoder for media parts,
then the thinker; the talker for speech: speech.py; for MODALITY_IMAGE the thinker in hidden-state
mode, then the image stage: imaging.py), passes the client's remaining deadline to each, and cancels
the stage streams when the client goes away. Embeddings go from the encoder to the thinker, and hidden
states from the thinker to the image stage, as TensorRefs, never through the gateway's memory; refs
that never reach their consumer are released here (media.py, imaging.py). Omni.Converse runs in
converse.py.

With MODALITY_IMAGE and MODALITY_TEXT (and/or MODALITY_AUDIO), the answer streams first (text, and
speech interleaved), then the image is made from the same conversation (a second thinker call; its
media encoded again, because the thinker consumes the encoder's refs when it takes a request); one
Finish ends the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.gateway.admission import GateConfig, StageGate, check_path
from omnistage.services.gateway.converse import Conversation, ConverseLimits
from omnistage.services.gateway.imaging import ImagePlan, ImageStage
from omnistage.services.gateway.media import MediaStage, thinker_items
from omnistage.services.gateway.media_path import check_media_paths
from omnistage.services.gateway.pace import PaceMeter, StepPace
from omnistage.services.gateway.request_metrics import GatewayMetrics
from omnistage.services.gateway.speech import SpeechStage, voice_choice
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.validation import PlannedRequest, RequestLimits, check_counts, plan_request
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
        speech: SpeechStage | None = None,
        images: ImageStage | None = None,
        converse: ConverseLimits = ConverseLimits(),
        gates: dict[str, StageGate] | None = None,
        service: str = "gateway",
    ) -> None:
        self.thinker = thinker
        self.metrics = GatewayMetrics(service)
        # Admission by capacity: a gate per stage (thinker, encoder, imagegen) with what its Describe
        # says it runs at once; a request is checked against every gate on its path at arrival.
        self.gates = gates or {}
        self.gates.setdefault("thinker", StageGate("thinker", GateConfig(), service))
        if images is not None:  # what the image stage denoises at once, and lets wait (its Describe)
            self.gates.setdefault("imagegen", StageGate("imagegen", images.limits.gate(), service))
        if speech is not None:  # the streams the talker speaks at once (its Describe): spoken answers wait
            self.gates.setdefault("talker", StageGate("talker", GateConfig(speech.talker.max_streams), service))
        self.media = media  # None: no encoder (media parts get FAILED_PRECONDITION)
        self.speech = speech  # None: no talker (MODALITY_AUDIO and Converse get FAILED_PRECONDITION)
        self.images = images  # None: no image stage (MODALITY_IMAGE gets FAILED_PRECONDITION)
        self.converse = converse
        self.deployed = deployed
        self.max_concurrent_requests = max_concurrent_requests
        self.limits = limits
        self.system_prompt = system_prompt
        self.media_dir = media_dir
        self.in_flight = 0
        # The thinker's measured step time by batch size (pace.py): a text request's own service time.
        self.pace = StepPace()
        self.default_max_tokens = 0  # the thinker's, from its Describe (0: unknown)

    async def Generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        arrived_at = time.monotonic()
        events = self.metrics.record("Generate", request, context, arrived_at,
                                     self._generate(request, context, arrived_at))  # fmt: skip
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                yield event

    async def _generate(self, request: omni_pb2.GenerateRequest, context: grpc.aio.ServicerContext,
                        arrived_at: float) -> AsyncIterator[omni_pb2.GenerateEvent]:  # fmt: skip
        check_counts(request, self.limits)  # before any per-message work
        # A file path is a permission question, asked next; resolving thousands of them (realpath,
        # stat) is file-system work for a worker thread, not the event loop (without a media_dir the
        # first path is refused at once).
        paths = (await asyncio.to_thread(check_media_paths, request, self.media_dir) if self.media_dir
                 else check_media_paths(request, self.media_dir))  # fmt: skip
        plan = plan_request(request, self.deployed, self.system_prompt, self.limits)
        image = self._plan_image(request, plan)
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
        self._admit(context, [*(["encoder"] if plan.media else []), "thinker", *(["talker"] if spoken and self.speech.talker.up else []),
                              *(["imagegen"] if image else [])], self._thinker_work(plan, image is not None))  # fmt: skip
        self.in_flight += 1
        on_its_way = self.thinker_gate.on_its_way()  # admitted: counted at the thinker's gate from now
        on_its_way.__enter__()
        try:
            finish: omni_pb2.GenerateEvent | None = None
            if image is None or plan.outputs - {omni_pb2.MODALITY_IMAGE}:
                answer = self._answer_events(plan, paths, context, choice, arrived_at)
                async with contextlib.aclosing(answer) as events:
                    async for event in events:  # closing cancels the thinker stream now if the client left
                        if image is not None and event.WhichOneof("event") == "finish":
                            finish = event
                        else:
                            yield event
                if image is None:
                    return
                if finish is None or finish.finish.reason not in _COMPLETE:
                    if finish is not None:
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
            on_its_way.__exit__(None, None, None)
            self.in_flight -= 1

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

    async def _answer_events(self, plan: PlannedRequest, paths: dict[str, Path], context, choice,
                             arrived_at: float) -> AsyncIterator[omni_pb2.GenerateEvent]:  # fmt: skip
        """The client's events of the answer: the encoder for media, the thinker's deltas (and the talker's
        speech when `choice` is set), then the finish."""
        async with self.talker_slot(choice is not None, context.time_remaining()):
            encoded: list[encoder_pb2.EncodedItem] = []
            if plan.media:
                encoded = await self._encode(plan, paths, context)
            handed_over = False  # the thinker's `started`: from then on the leases are its business
            events = self._thinker_events(plan, encoded, context)
            if choice is not None:
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

    def talker_slot(self, spoken: bool, remaining_s: float | None) -> contextlib.AbstractAsyncContextManager:
        """For a spoken answer, one of the talker's streams, waited for in FIFO order within the deadline
        (admission by capacity, as for the thinker): the speech is not refused because the talker is busy
        now. A talker that is down takes no slot (the answer is text, its status says why)."""
        gate = self.gates.get("talker")
        if not spoken or gate is None or not self.speech.talker.up:
            return contextlib.nullcontext()
        return gate.slot(remaining_s)

    async def _image_events(
        self, plan: PlannedRequest, image: ImagePlan, paths: dict[str, Path], usage: common_pb2.Usage, context
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The image: hidden states of the conversation's query block, then ImageGen's progress and PNG.
        The request's media go through the encoder again; refs of a thinker call that never answered
        `started` are released here."""
        assert self.images is not None
        reference = await self.images.reference_bytes(image, paths)
        encoded: list[encoder_pb2.EncodedItem] = []
        if plan.media:
            encoded = await self._encode(plan, paths, context)
        handed_over = False
        try:
            hidden = self._thinker_stream(plan, encoded, context, self.images.hidden_states_request())

            async def thinker_events() -> AsyncIterator[thinker_pb2.ThinkerEvent]:
                nonlocal handed_over
                async with contextlib.aclosing(hidden) as stream:
                    async for ev in stream:
                        handed_over = handed_over or ev.WhichOneof("event") == "started"
                        yield ev

            async with contextlib.aclosing(thinker_events()) as stream, \
                    self.gates["imagegen"].slot(context.time_remaining()):
                events = self.images.events(plan.request_id, image, stream, reference, usage,
                                            context.time_remaining)  # fmt: skip
                async with contextlib.aclosing(events) as image_events:
                    async for event in image_events:
                        yield event
        finally:
            if encoded and not handed_over:
                self.media.release(encoded)

    async def _thinker_events(self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem], context):
        """The client's events of the thinker stream; None marks `started` (the thinker has the rows)."""
        async with contextlib.aclosing(self._thinker_stream(plan, encoded, context)) as stream:
            async for ev in stream:
                yield _event(plan.request_id, ev)

    async def _thinker_stream(
        self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem], context,
        hidden_states: thinker_pb2.HiddenStatesRequest | None = None,
    ) -> AsyncIterator[thinker_pb2.ThinkerEvent]:
        """The thinker's events up to its finish (hidden-state mode with `hidden_states`)."""
        self._check_media_tokens(plan, encoded)
        finished = False
        mode = {"hidden_states": hidden_states} if hidden_states is not None else {}
        pace = PaceMeter()
        self.thinker_gate.arrived()  # no longer counted as on its way to this gate
        async with self.thinker_gate.slot(context.time_remaining()):  # a slot of the thinker's tested batch
            stream = self.thinker.generate(
                plan.request_id, plan.chat(encoded), plan.sampling, context.time_remaining(),
                multimodal=thinker_items(encoded), **mode,
            )  # fmt: skip
            try:
                async for ev in stream:
                    if ev.WhichOneof("event") == "delta":
                        pace.tokens(time.monotonic(), len(ev.delta.token_ids), self.thinker_gate.running)
                    yield ev
                    if ev.WhichOneof("event") == "finish":
                        finished = True
                        break
            except grpc.aio.AioRpcError as exc:
                raise self.thinker.error(exc) from exc
            finally:
                await stream.aclose()
                if (measured := pace.measured()) is not None:  # also of an answer cut by its deadline
                    self.pace.observe(*measured)
        if not finished:
            raise StageUnavailable("thinker: stream ended without a finish event")

    @property
    def thinker_gate(self) -> StageGate:
        return self.gates["thinker"]

    async def _encode(self, plan: PlannedRequest, paths: dict[str, Path], context) -> list[encoder_pb2.EncodedItem]:
        """The request's media through the encoder, in a slot of its gate."""
        gate = self.gates.get("encoder")
        async with gate.slot(context.time_remaining()) if gate else contextlib.nullcontext():
            return await self.media.encode(plan.request_id, plan.media, paths, context.time_remaining())

    def _admit(self, context, stages: list[str], work_s: dict[str, float] | None = None) -> None:
        """Refuse at arrival (RESOURCE_EXHAUSTED with a retry hint) what cannot finish in time: the
        gateway's bound of requests, then the capacity of every gated stage on the request's path
        against its deadline (`work_s`: the request's own service time at a stage)."""
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(f"gateway at its limit of {self.max_concurrent_requests} requests", retry_after_ms=200,
                             reason="gateway_full")  # fmt: skip
        check_path([self.gates[s] for s in stages if s in self.gates], context.time_remaining(), work_s)

    def _thinker_work(self, plan: PlannedRequest, image: bool) -> dict[str, float]:
        """The thinker's time for the request's text answer: its max_tokens (or the thinker's default)
        and prompt at the measured step time of the batch it joins; {} while unmeasured."""
        gate = self.thinker_gate
        batch = gate.running + gate.waiting + gate.coming + 1
        if gate.cfg.max_running:
            batch = min(batch, gate.cfg.max_running)
        max_tokens = plan.sampling.max_tokens or self.default_max_tokens
        if image and not plan.outputs - {omni_pb2.MODALITY_IMAGE}:
            max_tokens = 1  # hidden-state mode only: one prefill
        work = self.pace.work_s(max_tokens, plan.prompt_chars, batch) if max_tokens else None
        return {} if work is None else {"thinker": work}

    def _check_media_tokens(self, plan: PlannedRequest, encoded: list[encoder_pb2.EncodedItem]) -> None:
        """Media alone longer than the thinker's context: refused here, before the thinker is called."""
        limit = self.limits.max_model_len
        tokens = sum(item.num_tokens for item in encoded)
        if limit and tokens >= limit:
            raise InvalidRequest(
                f"messages: the media parts take {tokens} prompt tokens, the thinker's max_model_len is {limit}"
            )

    async def Converse(self, request_iterator, context: grpc.aio.ServicerContext):
        events = self.metrics.record("Converse", None, context, time.monotonic(),
                                     self._converse(request_iterator, context))  # fmt: skip
        async with contextlib.aclosing(events) as stream:
            async for event in stream:
                yield event

    async def _converse(self, request_iterator, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[omni_pb2.GenerateEvent]:  # fmt: skip
        conversation = Conversation(self, context)
        config = await conversation.open(request_iterator)  # checks before the call counts as in flight
        self._admit(context, ["thinker"])
        self.in_flight += 1
        try:
            async for event in conversation.run(config):
                yield event
        finally:
            self.in_flight -= 1
