"""The gateway's request path: a checked request becomes a RequestPlan, is admitted once (a Ticket),
and runs as one RequestRun through the stages its plan names."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from omnistage.common.config import GatewayConfig
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.stages import STAGES, Stage
from omnistage.services.gateway.admission import GateConfig, StageGate
from omnistage.services.gateway.answer import COMPLETE, Answer
from omnistage.services.gateway.encode_cache import EncodeCache, KeptMedia
from omnistage.services.gateway.media import EncodedMedia, MediaStage
from omnistage.services.gateway.outputs import OutputStage
from omnistage.services.gateway.plan import Planner, RequestPlan
from omnistage.services.gateway.run import RequestRun
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.ticket import Admission, Ticket
from omnistage.services.gateway.validation import PlannedRequest, RequestLimits, plan_request
from omnistage.v1 import common_pb2, control_pb2, omni_pb2, thinker_pb2


class CallContext(Protocol):
    """What the pipeline asks of a call's context (a grpc.aio.ServicerContext; start-up's warm-ups pass
    their own): the seconds left to the client's deadline, None without one."""

    def time_remaining(self) -> float | None: ...


def output_kinds(stages: Sequence[Stage]) -> dict[int, str]:
    """Output modality → the stage kind that makes it, from the stage table's rows."""
    return {omni_pb2.Modality.Value(f"MODALITY_{o.upper()}"): s.kind for s in stages for o in s.outputs}


class Pipeline:
    """Runs requests through the stages; owns the stage clients (the thinker's, the encoder's behind
    MediaStage, the output stages by kind: outputs/) and the one Admission of their gates.

    A stage that is None (absent) was not deployed or not reached at start-up (the gateway started
    degraded): requests that need it get FAILED_PRECONDITION / UNAVAILABLE naming it.
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
        kept: EncodeCache | None = None,
        speech: OutputStage | None = None,
        images: OutputStage | None = None,
        outputs: Sequence[OutputStage] = (),
        gates: dict[str, StageGate] | None = None,
        service: str = "gateway",
        buffer_events: int = GatewayConfig.speech_buffer_events,
        stages: Sequence[Stage] = STAGES,
    ) -> None:
        self.thinker = thinker
        self.media = media
        # Conversations' encoded clips, kept across their turns (and made ahead of a Realtime turn's end);
        # None: each Converse turn encodes its window's clips again.
        self.kept = kept
        self.deployed = deployed
        self.limits = limits
        self.system_prompt = system_prompt
        self.service = service
        self.buffer_events = buffer_events  # a run's events waiting for its client
        self.outputs = {o.kind: o for o in (*outputs, speech, images) if o is not None}
        # Admission by capacity: a gate per stage with what its Describe says it runs at once.
        self.admission = Admission(max_concurrent_requests, gates or {}, service)
        for stage in self.outputs.values():
            stage.gate = self.admission.add_gate(stage.kind, GateConfig(), joins=stage.joins)
        kinds = output_kinds(stages)
        self.planner = Planner(
            deployed,
            limits,
            system_prompt,
            media_dir,
            thinker is not None,
            media is not None,
            {m: self.outputs[k] for m, k in kinds.items() if k in self.outputs},
            kinds,
        )
        self.stages_changed()

    @property
    def speech(self) -> OutputStage | None:
        return self.outputs.get("talker")

    @property
    def images(self) -> OutputStage | None:
        return self.outputs.get("imagegen")

    @property
    def in_flight(self) -> int:
        return self.admission.in_flight

    @property
    def thinker_gate(self) -> StageGate:
        return self.admission.thinker_gate

    # -- what the stage watches learn (startup.py) ------------------------------------------------

    def thinker_described(self, limits: control_pb2.Limits) -> None:
        self.admission.thinker_described(limits)

    def stages_changed(self) -> None:
        """A stage replica was admitted or went down (its watch): the output stages' gates follow the
        replicas that are up (a replica that goes down leaves the path, the gate stays)."""
        for stage in self.outputs.values():
            self.admission.set_capacity(stage.kind, *stage.capacity())

    # -- Omni.Generate ----------------------------------------------------------------------------

    async def generate(
        self, request: omni_pb2.GenerateRequest, context: CallContext, arrived_at: float
    ) -> RequestRun:
        """Plan and admit the request, and start its run (the caller reads its events and closes it)."""
        plan = await self.plan(request, arrived_at)
        ticket = self.admission.admit(plan, context.time_remaining())
        run = RequestRun(plan.request.request_id, self.buffer_events, arrived_at)
        run.on_end(ticket.release)
        media = EncodedMedia(
            self.media, plan.request, plan.paths, lambda r: ticket.slot("encoder", r), plan.thinker_calls
        )
        run.on_end(media.release)
        answer = Answer(
            self.thinker, self.admission, run, ticket, plan.request, media, context.time_remaining
        )
        run.start(self._generate(answer, plan), "answer")
        return run

    async def plan(self, request: omni_pb2.GenerateRequest, arrived_at: float) -> RequestPlan:
        """Check the request against the deployed stages and limits, and the context rule (what can never
        be served is INVALID_ARGUMENT, whatever the load): checked once, here."""
        plan = await self.planner.plan(request, arrived_at)
        self.admission.check_context(plan.request)
        return plan

    async def _generate(self, answer: Answer, plan: RequestPlan) -> None:
        """The answer (text, with the outputs that run during it), then the outputs after it (when it
        completed); one Finish ends the stream (an answer cut short gets no image)."""
        finish = None
        if plan.answers:
            during = [o for o in plan.outputs if not o.after_answer]
            finish = await answer.text(
                [self.outputs[o.kind].during(answer.run, o.options, answer) for o in during]
            )
        for out in (o for o in plan.outputs if o.after_answer):
            if finish is not None and finish.finish.reason not in COMPLETE:
                break
            if finish is None:
                finish = omni_pb2.GenerateEvent(
                    request_id=plan.request.request_id,
                    finish=omni_pb2.Finish(reason=common_pb2.FINISH_REASON_STOP),
                )
            finish = await self.outputs[out.kind].after(answer, out.options, finish)
        await answer.run.finish(finish)

    # -- Omni.Converse ----------------------------------------------------------------------------

    async def answer_turn(
        self,
        run: RequestRun,
        ticket: Ticket,
        request: PlannedRequest,
        voice: object | None,
        remaining: Callable[[], float | None],
    ) -> omni_pb2.GenerateEvent:
        """One Converse answer in `run`: its media encoded (outside the encoder's gate: a conversation
        is admitted once, at the thinker's) or found kept, its text, spoken when `voice` is given; its
        Finish."""
        media = (
            KeptMedia(self.kept, request)
            if self.kept is not None
            else EncodedMedia(self.media, request, {}, None)
        )
        answer = Answer(self.thinker, self.admission, run, ticket, request, media, remaining, "config.")
        try:
            sinks = [self.outputs["talker"].during(run, voice, answer)] if voice is not None else []
            return await answer.text(sinks)
        finally:
            media.release()

    def conversation_ended(self, request_id: str) -> None:
        """A Converse call ended: the clips kept for it go."""
        if self.kept is not None:
            self.kept.end(request_id)

    # -- Omni.Tokenize / Detokenize ---------------------------------------------------------------

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
        asked = thinker_pb2.TokenizeRequest(chat=planned.chat())
        return await self._thinker().tokenize(asked, context.time_remaining())

    async def detokenize(
        self, request: common_pb2.DetokenizeRequest, context: CallContext
    ) -> common_pb2.DetokenizeResponse:
        """Omni.Detokenize: the thinker's text of token ids."""
        return await self._thinker().detokenize(request, context.time_remaining())

    def _thinker(self) -> ThinkerClient:
        if self.thinker is None:
            raise StageUnavailable("the 'thinker' stage is not available (gateway started degraded)")
        return self.thinker
