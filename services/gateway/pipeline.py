"""The gateway's request path: a checked request becomes a RequestPlan, and one Pipeline runs it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc
from omnistage.common.runtime.errors import InvalidRequest, Overloaded, StageUnavailable
from omnistage.services.gateway.admission import GateConfig, StageGate, check_path
from omnistage.services.gateway.expected_cost import AdmittedText, OutputLengths
from omnistage.services.gateway.imaging import ImagePlan, ImageStage
from omnistage.services.gateway.media import MediaStage, thinker_items
from omnistage.services.gateway.media_path import check_media_paths
from omnistage.services.gateway.pace import PaceMeter, StepPace
from omnistage.services.gateway.speech import SpeechStage, SpokenAnswer, VoiceChoice, voice_choice
from omnistage.services.gateway.stages import HandedOver, ThinkerClient
from omnistage.services.gateway.tools import tool_events
from omnistage.services.gateway.validation import (
    PlannedRequest,
    RequestLimits,
    check_context,
    check_counts,
    plan_request,
)
from omnistage.v1 import common_pb2, control_pb2, encoder_pb2, omni_pb2, thinker_pb2

# A text answer that ended so is followed by the image, when one is asked for too, and its length
# counts for what answers of its kind produce (expected_cost.py).
_COMPLETE = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING,
)
# Leases this close to their expiry are not sent to a thinker call: they are encoded again.
_LEASE_MARGIN_MS = 1000


class CallContext(Protocol):
    """What the pipeline asks of a call's context (a grpc.aio.ServicerContext; start-up's warm-ups pass
    their own): the seconds left to the client's deadline, None without one."""

    def time_remaining(self) -> float | None: ...


def client_event(request_id: str, ev: thinker_pb2.ThinkerEvent) -> omni_pb2.GenerateEvent | HandedOver:
    """The client's event for a thinker event (with the client's request_id); HandedOver for `started`,
    whose engine id stays inside (the gateway aborts by cancelling the stage stream)."""
    kind = ev.WhichOneof("event")
    if kind == "started":
        return HandedOver(prompt_tokens=ev.started.prompt_tokens)
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


@dataclass(frozen=True)
class RequestPlan:
    """A checked Generate request: what it runs, in which order."""

    request: PlannedRequest
    paths: dict[str, Path]  # media_dir files of its `Media.path` parts, by field path
    arrived_at: float
    voice: VoiceChoice | None = None  # the answer is spoken (the talker)
    image: ImagePlan | None = None  # an image follows the answer (thinker hidden states → image stage)

    @property
    def answers(self) -> bool:
        """A text answer streams (first): asked for, or no image is."""
        return self.image is None or bool(self.request.outputs - {omni_pb2.MODALITY_IMAGE})

    @property
    def thinker_calls(self) -> int:
        """The thinker calls that read the media: the answer's and the image's hidden states."""
        return int(self.answers) + int(self.image is not None)

    @property
    def stages(self) -> list[str]:
        """The stages it passes, in order (its admission judges the gate of each)."""
        return [
            *(["encoder"] if self.request.media else []),
            "thinker",
            *(["talker"] if self.voice else []),
            *(["imagegen"] if self.image else []),
        ]


class EncodedMedia:
    """A request's media, encoded at the first thinker call that needs them, and their leases: kept by
    the gateway for all but the last call, handed to the thinker by that one's `started`, released
    here for whatever no thinker took (`release`, when the request ends)."""

    def __init__(
        self,
        pipeline: Pipeline,
        request: PlannedRequest,
        paths: dict[str, Path],
        context: CallContext,
        calls: int = 1,
        *,
        gated: bool = True,
    ) -> None:
        self.pipeline = pipeline
        self.request = request
        self.paths = paths
        self.context = context
        self.calls_left = calls
        self.gated = gated  # Generate's encoding waits for a slot of the encoder's gate; Converse's does not
        self.items: list[encoder_pb2.EncodedItem] = []
        self.held = False  # the gateway holds the items' leases
        self.encodes = 0

    async def for_call(self) -> list[encoder_pb2.EncodedItem]:
        """The encoder's outputs for the next thinker call: encoded the first time (and again when their
        leases would run out before that call takes them)."""
        self.calls_left -= 1
        if not self.request.media:
            return []
        if self.items and _expiring(self.items):
            self.release()
            self.items = []
        if not self.items:
            self.items = await self.pipeline.encode(self.request, self.paths, self.context, gated=self.gated)
            self.held, self.encodes = True, self.encodes + 1
        return self.items

    def thinker_items(self) -> list[thinker_pb2.MultimodalEmbedding]:
        """The thinker's view of the items; a call that is not the last one leaves the leases here."""
        items = thinker_items(self.items)
        for item in items:
            item.caller_keeps_lease = self.calls_left > 0
        return items

    def taken(self) -> None:
        """The thinker took the call (`started`): after the last call, the leases are its business."""
        if self.calls_left <= 0:
            self.held = False

    def release(self) -> None:
        if self.held and self.items:
            self.pipeline.media.release(self.items)
        self.held = False


def _kind(request: PlannedRequest) -> tuple[int, ...]:
    """What answers are alike in length: those asked for the same output modalities."""
    return tuple(sorted(request.outputs))


def _nothing_held() -> None:
    """The release of a slot that was not taken."""


def _expiring(items: Sequence[encoder_pb2.EncodedItem]) -> bool:
    soon = time.time() * 1000 + _LEASE_MARGIN_MS
    for item in items:
        ref = item.embeddings
        kind = ref.WhichOneof("payload")
        sub = ref.shm if kind == "shm" else ref.cuda if kind == "cuda" else None
        if sub is not None and sub.lease_expiry_unix_ms and sub.lease_expiry_unix_ms < soon:
            return True
    return False


class Pipeline:
    """Runs requests through the stages; owns the stage clients, their gates and the lease hand-over.

    A stage that is None was not deployed or not reached at start-up (the gateway started degraded):
    requests that need it get FAILED_PRECONDITION / UNAVAILABLE naming it.
    """

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
        gates: dict[str, StageGate] | None = None,
        service: str = "gateway",
    ) -> None:
        self.thinker = thinker
        self.media = media
        self.speech = speech
        self.images = images
        self.deployed = deployed
        self.max_concurrent_requests = max_concurrent_requests
        self.limits = limits
        self.system_prompt = system_prompt
        self.media_dir = media_dir
        self.service = service
        # Admission by capacity: a gate per stage (thinker, encoder, talker, imagegen) with what its
        # Describe says it runs at once; a request is checked against every gate on its path at arrival.
        self.gates = gates or {}
        self.gates.setdefault("thinker", StageGate("thinker", GateConfig(), service))
        if images is not None:  # what the image stage denoises at once, and lets wait (its Describe)
            self.gates.setdefault("imagegen", StageGate("imagegen", images.limits.gate(), service))
        if speech is not None:  # the streams the talker speaks at once (its Describe): spoken answers wait
            self.gates.setdefault("talker", StageGate("talker", GateConfig(speech.capacity()), service))
        self.in_flight = 0
        # The thinker's measured step time by batch size (pace.py), what answers of each kind produce
        # and the text requests admitted (expected_cost.py): a text request's own service time.
        self.pace = StepPace()
        self.lengths = OutputLengths()
        self.text = AdmittedText()
        self.default_max_tokens = 0  # the thinker's, from its Describe (0: unknown)
        self.max_model_len = 0  # the thinker's, from its Describe (0: unknown; then the thinker alone checks)

    @property
    def thinker_gate(self) -> StageGate:
        return self.gates["thinker"]

    # -- what the stage watches learn (gateway/__main__.py) --------------------------------------

    def thinker_described(self, limits: control_pb2.Limits) -> None:
        """The thinker's Describe: its batch and default max_tokens (admission's measure of a request),
        and its max_model_len (what no request can pass, refused before admission)."""
        self.thinker_gate.set_capacity(limits.max_running_requests)
        self.default_max_tokens = limits.default_max_tokens
        self.max_model_len = limits.max_model_len

    def set_capacity(self, stage: str, max_running: int) -> None:
        """What a stage runs at once (its Describe, read again after a restart)."""
        self.gates[stage].set_capacity(max_running)

    def size_image_gate(self) -> None:
        """The `imagegen` gate admits what the image replicas that are up take together."""
        if self.images is not None:
            self.gates["imagegen"].set_capacity(*self.images.capacity())

    def size_talker_gate(self) -> None:
        """The `talker` gate admits the streams of the talker replicas that are up, together: a replica
        that goes down leaves the path (its streams leave the gate), the gate stays."""
        if self.speech is not None:
            self.gates["talker"].set_capacity(self.speech.capacity())
            self.speech.credit_back()

    def stages_changed(self) -> None:
        """A stage replica was admitted or went down (its watch): the replicated stages' gates follow."""
        self.size_image_gate()
        self.size_talker_gate()

    # -- Omni.Generate ----------------------------------------------------------------------------

    async def generate(
        self, request: omni_pb2.GenerateRequest, context: CallContext, arrived_at: float
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """Plan, admit, then run the plan: the answer (text, speech interleaved), then the image; one
        Finish ends the stream (an answer cut short gets no image)."""
        plan = await self.plan(request, arrived_at)
        self.check_context(plan.request)  # never possible: INVALID_ARGUMENT, whatever the load
        self.admit(context, plan.stages, self.thinker_work(plan))
        media = EncodedMedia(self, plan.request, plan.paths, context, plan.thinker_calls)
        with self.admitted(plan, context):  # counted at the thinker's gate and in its batch from now
            try:
                finish: omni_pb2.GenerateEvent | None = None
                if plan.answers:
                    answer = self.answer(plan.request, media, context, plan.voice, plan.arrived_at)
                    async with contextlib.aclosing(answer) as events:  # closing cancels the stage streams now
                        async for event in events:
                            if isinstance(event, HandedOver):
                                continue
                            if plan.image is not None and event.HasField("finish"):
                                finish = event
                            else:
                                yield event
                    if plan.image is None or finish is None or finish.finish.reason not in _COMPLETE:
                        if plan.image is not None and finish is not None:
                            yield finish
                        return
                async with contextlib.aclosing(self._image(plan, media, finish, context)) as events:
                    async for event in events:
                        yield event
            finally:
                media.release()

    async def tokenize(
        self, request: omni_pb2.GenerateRequest, context: CallContext
    ) -> common_pb2.TokenizeResponse:
        """Omni.Tokenize: the thinker's ids of the request's prompt, checked as Generate checks it."""
        for i, msg in enumerate(request.messages):
            for j, part in enumerate(msg.parts):
                if part.WhichOneof("content") not in ("text", None):
                    raise InvalidRequest(
                        f"messages[{i}].parts[{j}]: media are not tokenized here (their token counts "
                        "come from the encoder: Generate reports them in usage.prompt_tokens)"
                    )
        planned = plan_request(request, self.deployed, self.system_prompt, self.limits)
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        asked = thinker_pb2.TokenizeRequest(chat=planned.chat())
        return await self.thinker.tokenize(asked, context.time_remaining())

    async def detokenize(
        self, request: common_pb2.DetokenizeRequest, context: CallContext
    ) -> common_pb2.DetokenizeResponse:
        """Omni.Detokenize: the thinker's text of token ids."""
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        return await self.thinker.detokenize(request, context.time_remaining())

    async def plan(self, request: omni_pb2.GenerateRequest, arrived_at: float) -> RequestPlan:
        """Check the request (counts first, then file paths, then the rest) against the deployed stages."""
        check_counts(request, self.limits)  # before any per-message work
        # A file path is a permission question, asked next; resolving thousands of them (realpath,
        # stat) is file-system work for a worker thread, not the event loop (without a media_dir the
        # first path is refused at once).
        paths = (
            await asyncio.to_thread(check_media_paths, request, self.media_dir)
            if self.media_dir
            else check_media_paths(request, self.media_dir)
        )
        planned = plan_request(request, self.deployed, self.system_prompt, self.limits)
        image = self._plan_image(request, planned)
        spoken = omni_pb2.MODALITY_AUDIO in planned.outputs
        voice = voice_choice(request) if spoken else None
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        if planned.media and self.media is None:
            raise StageUnavailable(
                f"{planned.media[0].where}: the 'encoder' stage is not available (gateway started degraded)"
            )
        if spoken and self.speech is None:
            raise StageUnavailable("output_modalities: the 'talker' stage is not available", retryable=False)
        return RequestPlan(planned, paths, arrived_at, voice, image)

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

    def check_context(self, request: PlannedRequest) -> None:
        """Refuse what no thinker call can serve (max_tokens past the thinker's max_model_len) before
        admission: a request that can never be served is INVALID_ARGUMENT, not "not now"."""
        check_context(request.sampling, request.least_prompt_tokens, self.max_model_len)

    def admit(self, context: CallContext, stages: list[str], work_s: dict[str, float] | None = None) -> None:
        """Refuse at arrival (RESOURCE_EXHAUSTED with a retry hint) what cannot finish in time: the
        gateway's bound of requests, then the capacity of every gated stage on the request's path
        against its deadline (`work_s`: the request's own service time at a stage). A talker that is
        down is no stage of the path: the answer goes on as text (its AudioStatus says why)."""
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(
                f"gateway at its limit of {self.max_concurrent_requests} requests in flight "
                "(gateway.max_concurrent_requests)",
                retry_after_ms=200,
                reason="gateway_full",
            )
        talker_down = self.speech is not None and not self.speech.replicas.up()
        gates = [self.gates[s] for s in stages if s in self.gates and not (s == "talker" and talker_down)]
        check_path(gates, context.time_remaining(), work_s)
        if work_s and "thinker" in work_s:
            self._check_join()

    @contextlib.contextmanager
    def admitted(self, plan: RequestPlan, context: CallContext) -> Iterator[None]:
        """An admitted Generate request for the block: in flight, on its way to the thinker's gate, and
        (with a text answer) one of the admitted text requests whose deadlines later arrivals keep."""
        text = (
            self.text.admitted(context.time_remaining(), self.expected_tokens(plan))
            if plan.answers
            else contextlib.nullcontext()
        )
        with self.counted(), self.thinker_gate.on_its_way(), text:
            yield

    @contextlib.contextmanager
    def counted(self) -> Iterator[None]:
        """The request is in flight (the gateway's bound) for the block."""
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1

    def expected_tokens(self, plan: RequestPlan) -> int:
        """Tokens the request's text answer is priced at: what finished answers of its kind produced,
        within its max_tokens (or the thinker's default, clamped to its context); 0: unknown."""
        if not plan.answers:
            return 1  # hidden-state mode only: one prefill
        request = plan.request
        cap = request.sampling.max_tokens or self.default_max_tokens
        if self.max_model_len:
            cap = min(cap, self.max_model_len - request.least_prompt_tokens)
        return self.lengths.expected(_kind(request), cap) if cap > 0 else 0

    def thinker_work(self, plan: RequestPlan) -> dict[str, float]:
        """The thinker's time for the request's text answer: its expected tokens and prompt at the
        measured step time of the batch it joins; {} while unmeasured."""
        tokens = self.expected_tokens(plan)
        work = self.pace.work_s(tokens, plan.request.prompt_chars, self._joined_batch()) if tokens else None
        return {} if work is None else {"thinker": work}

    def _joined_batch(self) -> int:
        """The thinker's batch with one more request (at most what it runs at once)."""
        gate = self.thinker_gate
        batch = gate.running + gate.waiting + gate.coming + 1
        return min(batch, gate.cfg.max_running) if gate.cfg.max_running else batch

    def _check_join(self) -> None:
        """Refuse now (Overloaded) a request whose joining the thinker's batch would make an admitted
        one late that finishes in time at today's batch: each step slows as the batch grows. A request
        that has to wait for a slot does not slow the batch (the wait estimate judged it)."""
        gate = self.thinker_gate
        batch = gate.running + gate.waiting + gate.coming + 1
        if batch < 2 or (gate.cfg.max_running and batch > gate.cfg.max_running):
            return
        step_now, step_joined = self.pace.step_s(batch - 1), self.pace.step_s(batch)
        late = (
            None if step_now is None or step_joined is None else self.text.slowed_late(step_now, step_joined)
        )
        if late is not None:
            request, done_in_s = late
            gate.refused += 1
            raise Overloaded(
                f"thinker: joining its batch of {batch - 1} would slow an admitted request past its deadline "
                f"({request.left()} tokens left at {step_joined:.3f}s a step instead of {step_now:.3f}s)",
                retry_after_ms=max(1, int(done_in_s * 1000)),
                reason="thinker_deadline",
            )

    # -- the steps ---------------------------------------------------------------------------------

    async def answer(
        self,
        request: PlannedRequest,
        media: EncodedMedia,
        context: CallContext,
        voice: VoiceChoice | None,
        arrived_at: float,
        where: str = "",
    ) -> AsyncIterator[omni_pb2.GenerateEvent | HandedOver]:
        """The answer's events: in a talker slot when spoken (`voice`), the media encoded, then the
        thinker's text with the talker's speech interleaved, HandedOver (carrying the SpokenAnswer) when
        the thinker took the request, and the Finish. `where` prefixes field names in errors."""
        async with self.talker_slot(voice is not None, context.time_remaining()) as speech_over:
            await media.for_call()
            events = self._thinker(request, media, context, lambda ev: client_event(request.request_id, ev))
            if request.tools is not None:  # calls in the text become ToolCall events
                events = tool_events(events, request.tools, request.request_id)
            spoken = None
            if voice is not None:
                spoken = SpokenAnswer(
                    self.speech,
                    request.request_id,
                    voice,
                    context.time_remaining(),
                    arrived_at,
                    where,
                    on_speech_over=speech_over,
                )
                events = spoken.events(events)
            async with contextlib.aclosing(
                events
            ) as stream:  # cancels the thinker stream now if the client left
                async for event in stream:
                    yield (
                        dataclasses.replace(event, speech=spoken) if isinstance(event, HandedOver) else event
                    )

    def talker_slot(self, spoken: bool, remaining_s: float | None) -> contextlib.AbstractAsyncContextManager:
        """For a spoken answer, one of the streams of the talker replicas that are up, waited for in FIFO
        order within the deadline (admission by capacity, as for the thinker): the speech is not refused
        because the talkers are busy now, and goes to whichever replica has the stream. Yields the
        function that gives the stream back when the speech is over (its Speak call ended), before the
        answer's text. No replica up takes no slot (the answer is text, its status says why)."""
        gate = self.gates.get("talker")
        if not spoken or gate is None or not self.speech.replicas.up():
            return contextlib.nullcontext(_nothing_held)
        return gate.slot(remaining_s)

    async def encode(
        self, request: PlannedRequest, paths: dict[str, Path], context: CallContext, *, gated: bool = True
    ) -> list[encoder_pb2.EncodedItem]:
        """The request's media through the encoder (in a slot of its gate when `gated`)."""
        gate = self.gates.get("encoder") if gated else None
        async with gate.slot(context.time_remaining()) if gate else contextlib.nullcontext():
            return await self.media.encode(request.request_id, request.media, paths, context.time_remaining())

    async def _image(
        self,
        plan: RequestPlan,
        media: EncodedMedia,
        finish: omni_pb2.GenerateEvent | None,
        context: CallContext,
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """The image: hidden states of the conversation's query block (the thinker again, with the
        media encoded for the answer), then ImageGen's progress and PNG, then the Finish (the answer's,
        its usage with the hidden-state call's prompt added)."""
        assert self.images is not None and plan.image is not None
        usage = common_pb2.Usage()
        if finish is None:
            finish = omni_pb2.GenerateEvent(
                request_id=plan.request.request_id,
                finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP),
            )
        else:
            usage.CopyFrom(finish.finish.usage)
        reference = await self.images.reference_bytes(plan.image, plan.paths)
        await media.for_call()
        hidden = self._thinker(
            plan.request, media, context, hidden_states=self.images.hidden_states_request()
        )
        async with (
            contextlib.aclosing(hidden) as stream,
            self.gates["imagegen"].slot(context.time_remaining()),
        ):
            events = self.images.events(
                plan.request.request_id, plan.image, stream, reference, usage, context.time_remaining
            )
            async with contextlib.aclosing(events) as image_events:
                async for event in image_events:
                    yield event
        finish.finish.usage.CopyFrom(usage)
        yield finish

    async def _thinker(
        self,
        request: PlannedRequest,
        media: EncodedMedia,
        context: CallContext,
        to_event: Callable[[thinker_pb2.ThinkerEvent], Any] = lambda ev: ev,
        hidden_states: thinker_pb2.HiddenStatesRequest | None = None,
    ) -> AsyncIterator[Any]:
        """One thinker call in a slot of its gate, `to_event` of each of its events up to the finish
        (hidden-state mode with `hidden_states`); its `started` hands the media's leases over."""
        finished = False
        mode = {"hidden_states": hidden_states} if hidden_states is not None else {}
        pace = PaceMeter()
        self.thinker_gate.arrived()  # no longer counted as on its way to this gate
        async with self.thinker_gate.slot(context.time_remaining()):  # a slot of the thinker's tested batch
            stream = self.thinker.generate(
                request.request_id,
                request.chat(media.items),
                request.sampling,
                context.time_remaining(),
                multimodal=media.thinker_items(),
                **mode,
            )
            try:
                async for ev in stream:
                    kind = ev.WhichOneof("event")
                    if kind == "started":
                        media.taken()
                    elif kind == "delta":
                        count = len(ev.delta.token_ids)
                        self.text.tokens(count)
                        live = pace.tokens(time.monotonic(), count, self.thinker_gate.running)
                        if live is not None:
                            self.pace.observe(*live)
                    elif kind == "finish" and hidden_states is None and ev.finish.reason in _COMPLETE:
                        self.lengths.observe(
                            _kind(request),
                            ev.finish.usage.completion_tokens,
                            ev.finish.reason == common_pb2.FINISH_REASON_LENGTH,
                        )
                    yield to_event(ev)
                    if kind == "finish":
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
