"""What clients of the gateway got, in Prometheus: time to first token and end-to-end latency as the
client sees them, goodput, refusals by reason, and the tokens, audio and images streamed back.

`GatewayMetrics.record(...)` wraps one call's event stream: each event is looked at once as it goes
out (a few attribute reads), and the call's end is counted with the status the client gets.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc
from omnistage.common import metrics
from omnistage.common.answer_outcome import OK, answer_code
from omnistage.common.runtime.calls import status_of
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.stages import MODEL_KINDS
from omnistage.v1 import omni_pb2

# Refusals (RESOURCE_EXHAUSTED at arrival) the gateway makes itself; `stage` for a stage's own refusal.
REFUSAL_REASONS = (
    "gateway_full",
    *(f"{stage}_{why}" for stage in MODEL_KINDS for why in ("queue_full", "deadline")),
    "stage",
)
_MODALITY_NAMES = {
    omni_pb2.MODALITY_TEXT: "text",
    omni_pb2.MODALITY_AUDIO: "audio",
    omni_pb2.MODALITY_IMAGE: "image",
}


def modality_label(request: omni_pb2.GenerateRequest) -> str:
    """The output modalities of a request as one label: `text`, `audio+text`, `image`, `image+text`, ...
    (none asked: `text`; a value the API does not know: `invalid`, refused later)."""
    names = {_MODALITY_NAMES.get(m, "invalid") for m in request.output_modalities} or {"text"}
    return "invalid" if "invalid" in names else "+".join(sorted(names))


class GatewayMetrics:
    """The gateway's client-side metrics (one per process)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self.ttft = metrics.histogram(
            "gateway_ttft_seconds",
            "Time to first token as the client sees it: "
            "request arrival at the gateway to the first text event sent, by output "
            "modalities",
            ("modality",),
        )
        self.e2e = metrics.histogram(
            "gateway_e2e_seconds",
            "Omni.Generate wall time at the gateway, arrival to "
            "the stream's end, by output modalities and the gRPC status the client got",
            ("modality", "outcome"),
        )
        self.goodput = metrics.counter(
            "gateway_goodput_requests",
            "Omni.Generate requests that ended OK within "
            "their deadline with their answer done (finish not ERROR or ABORT; a "
            "spoken one with its speech complete), by output modalities",
            ("modality",),
        )
        refusals = metrics.counter(
            "gateway_refusals",
            "Requests refused with RESOURCE_EXHAUSTED, by reason "
            "(gateway_full, <stage>_queue_full, <stage>_deadline, stage)",
            ("reason",),
        )
        self.refusals = {r: refusals.labels(service, r) for r in REFUSAL_REASONS}
        self.tokens = metrics.counter(
            "gateway_streamed_tokens", "Text tokens streamed to clients, by method", ("method",)
        )
        self.audio_s = metrics.counter(
            "gateway_audio_seconds", "Seconds of speech streamed to clients, by method", ("method",)
        )
        self.images = metrics.counter("gateway_images", "Images sent to clients")
        for method in ("Generate", "Converse"):
            self.tokens.labels(service, method)
            self.audio_s.labels(service, method)
        self.images.labels(service)

    async def record(
        self,
        method: str,
        request: omni_pb2.GenerateRequest | None,
        context: grpc.aio.ServicerContext,
        arrived_at: float,
        events: AsyncIterator[omni_pb2.GenerateEvent],
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """`events` as they are, counted. With `request` (Generate) the call's TTFT, E2E and goodput too."""
        timed = request is not None
        modality = modality_label(request) if timed else ""
        remaining = context.time_remaining() if timed else None
        deadline = None if remaining is None else arrived_at + remaining
        tokens = self.tokens.labels(self.service, method)
        audio = self.audio_s.labels(self.service, method)
        first_text, finish = timed, None
        spoken = timed and omni_pb2.MODALITY_AUDIO in request.output_modalities
        try:
            async with contextlib.aclosing(events) as stream:  # closed at once when the client leaves
                async for event in stream:
                    kind = event.WhichOneof("event")
                    if kind == "text":
                        if first_text:
                            first_text = False
                            self.ttft.labels(self.service, modality).observe(time.monotonic() - arrived_at)
                        tokens.inc(len(event.text.token_ids))
                    elif kind == "audio":
                        if event.audio.sample_rate_hz:
                            audio.inc(len(event.audio.pcm16) / 2 / event.audio.sample_rate_hz)
                    elif kind == "image":
                        self.images.labels(self.service).inc()
                    elif kind == "finish":
                        finish = event.finish
                    yield event
        except BaseException as exc:
            if isinstance(exc, Overloaded):
                self.refusals.get(exc.reason or "stage", self.refusals["stage"]).inc()
            if timed:
                code = status_of(exc, context)[0]
                self.e2e.labels(self.service, modality, code.name).observe(time.monotonic() - arrived_at)
            raise
        if timed:
            ended = time.monotonic()
            self.e2e.labels(self.service, modality, grpc.StatusCode.OK.name).observe(ended - arrived_at)
            done = answer_code(finish, spoken=spoken) == OK  # the definition `omnistage bench` uses
            if done and (deadline is None or ended <= deadline):
                self.goodput.labels(self.service, modality).inc()
