"""One answer of a run: the thinker's calls for it (the text answer, and the hidden states an output
after it needs), each in a slot of the thinker's gate, with the media's leases handed over at its
`started` and the thinker's pace and answer lengths measured on the way."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import grpc
from omnistage.common.runtime.errors import StageUnavailable
from omnistage.services.gateway.media import EncodedMedia
from omnistage.services.gateway.outputs import AnswerSink
from omnistage.services.gateway.pace import CHARS_PER_TOKEN, PaceMeter
from omnistage.services.gateway.run import RequestRun
from omnistage.services.gateway.stages import ThinkerClient
from omnistage.services.gateway.ticket import Admission, Ticket, answer_kind
from omnistage.services.gateway.tools import ToolEvents
from omnistage.services.gateway.validation import PlannedRequest
from omnistage.v1 import common_pb2, omni_pb2, thinker_pb2

# A text answer that ended so is followed by the outputs after it (the image), and its length counts
# for what answers of its kind produce (expected_cost.py).
COMPLETE = (
    common_pb2.FINISH_REASON_STOP,
    common_pb2.FINISH_REASON_LENGTH,
    common_pb2.FINISH_REASON_STOP_STRING,
)


@dataclass(eq=False)
class Answer:
    """The thinker's part of one run (`where` prefixes field names in the errors it makes)."""

    thinker: ThinkerClient
    admission: Admission
    run: RequestRun
    ticket: Ticket
    request: PlannedRequest
    media: EncodedMedia
    remaining: Callable[[], float | None]  # the seconds left to the client's deadline (None: none)
    where: str = ""

    async def text(self, sinks: Sequence[AnswerSink] = ()) -> omni_pb2.GenerateEvent:
        """Stream the text answer to the client (its tool calls as ToolCall events), each piece fed to
        the `sinks` of the outputs that run during it; the Finish, once they are done too, not sent."""
        request_id = self.request.request_id
        tools = ToolEvents(self.request.tools, request_id) if self.request.tools is not None else None
        finish: list[omni_pb2.GenerateEvent] = []

        async def on_event(ev: thinker_pb2.ThinkerEvent) -> None:
            kind = ev.WhichOneof("event")
            if kind == "started":
                self.run.handed_over, self.run.prompt_tokens = True, ev.started.prompt_tokens
                for sink in sinks:
                    sink.started()
                return
            event = client_event(request_id, ev)
            for out in tools.of(event) if tools is not None else (event,):
                if out.HasField("finish"):
                    finish.append(out)
                    continue
                if out.HasField("text"):
                    for sink in sinks:
                        await sink.text(out.text.text)
                await self.run.emit(out)

        if await self.media.for_call(self.remaining()):
            self.run.media_at = time.monotonic()
        await self._call(on_event)
        for sink in sinks:
            await sink.end(finish[0])
        return finish[0]

    async def hidden_states(
        self, ask: thinker_pb2.HiddenStatesRequest, into: list[thinker_pb2.HiddenStates]
    ) -> thinker_pb2.ThinkerFinish:
        """The thinker's hidden states of the request, appended to `into` as they come (their leases are
        the caller's from then on, even when the call fails after them), and its finish. The media
        encoded for the answer are used again, or encoded again when their leases ran out."""
        await self.media.for_call(self.remaining())

        async def on_event(ev: thinker_pb2.ThinkerEvent) -> None:
            if ev.WhichOneof("event") == "hidden_states":
                into.append(ev.hidden_states)

        return await self._call(on_event, hidden_states=ask)

    async def _call(
        self,
        on_event: Callable[[thinker_pb2.ThinkerEvent], Awaitable[None]],
        hidden_states: thinker_pb2.HiddenStatesRequest | None = None,
    ) -> thinker_pb2.ThinkerFinish:
        """One thinker call in a slot of its gate, `on_event` of each of its events up to the finish
        (hidden-state mode with `hidden_states`); its `started` hands the media's leases over."""
        request = self.request
        pace = PaceMeter(request.prompt_chars // CHARS_PER_TOKEN)
        mode = {"hidden_states": hidden_states} if hidden_states is not None else {}
        async with self.ticket.slot("thinker", self.remaining()):  # a slot of the thinker's tested batch
            stream = self.thinker.generate(
                request.request_id,
                request.chat(self.media.items),
                request.sampling,
                self.remaining(),
                multimodal=self.media.thinker_items(),
                **mode,
            )
            try:
                async for ev in stream:
                    kind = ev.WhichOneof("event")
                    if kind == "started":
                        self.media.taken()
                    elif kind == "delta":
                        self._paced(pace, len(ev.delta.token_ids))
                    elif kind == "finish" and hidden_states is None:
                        self._observe(ev.finish)
                    await on_event(ev)
                    if kind == "finish":
                        return ev.finish
            except grpc.aio.AioRpcError as exc:
                raise self.thinker.error(exc) from exc
            finally:
                await stream.aclose()
                if (measured := pace.measured()) is not None:  # also of an answer cut by its deadline
                    self.admission.pace.observe(*measured)
        raise StageUnavailable("thinker: stream ended without a finish event")

    def _paced(self, pace: PaceMeter, count: int) -> None:
        self.ticket.tokens(count)
        live = pace.tokens(time.monotonic(), count, self.admission.thinker_gate.running)
        if live is not None:
            self.admission.pace.observe(*live)

    def _observe(self, finish: thinker_pb2.ThinkerFinish) -> None:
        if finish.reason in COMPLETE:
            self.admission.lengths.observe(
                answer_kind(self.request),
                finish.usage.completion_tokens,
                finish.reason == common_pb2.FINISH_REASON_LENGTH,
            )


def client_event(request_id: str, ev: thinker_pb2.ThinkerEvent) -> omni_pb2.GenerateEvent:
    """The client's event for a thinker delta or finish (with the client's request_id)."""
    if ev.WhichOneof("event") == "delta":
        d = ev.delta
        return omni_pb2.GenerateEvent(
            request_id=request_id,
            text=omni_pb2.TextDelta(text=d.text, token_ids=d.token_ids, logprobs=d.logprobs),
        )
    f = ev.finish
    return omni_pb2.GenerateEvent(
        request_id=request_id, finish=omni_pb2.Finish(reason=f.reason, usage=f.usage, message=f.message)
    )
