"""What clients of the gateway got, in Prometheus: time to first token and end-to-end latency as the
client sees them, goodput, refusals by reason, and the tokens, audio and images streamed back.

`GatewayMetrics.call(...)` counts one call: each event is looked at once as it goes out (`sent`: a few
attribute reads), and the call's end (the end of its block) with the status the client gets.
"""

from __future__ import annotations

import time

import grpc
from omnistage.common import metrics
from omnistage.common.answer_outcome import OK, answer_code
from omnistage.common.runtime.calls import status_of
from omnistage.common.runtime.errors import Overloaded
from omnistage.common.stages import MODEL_KINDS, OUTPUT_KIND
from omnistage.v1 import omni_pb2

# Refusals (RESOURCE_EXHAUSTED at arrival) the gateway makes itself; `stage` for a stage's own refusal.
REFUSAL_REASONS = (
    "gateway_full",
    *(f"{stage}_{why}" for stage in MODEL_KINDS for why in ("queue_full", "deadline")),
    "stage",
)
# Output modality → its label: text, and the output kinds of the stage table's rows (audio, image).
_MODALITY_NAMES = {
    omni_pb2.MODALITY_TEXT: "text",
    **{omni_pb2.Modality.Value(f"MODALITY_{name.upper()}"): name for name in OUTPUT_KIND},
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

    def call(
        self,
        method: str,
        request: omni_pb2.GenerateRequest | None,
        context: grpc.aio.ServicerContext,
        arrived_at: float,
    ) -> CallRecord:
        """The counts of one call. With `request` (Generate) its TTFT, E2E and goodput too."""
        return CallRecord(self, method, request, context, arrived_at)


class CallRecord:
    """One call's events as they go out (`sent`), and its end: the end of its `with` block (an error
    raised out of it is the status the client gets)."""

    def __init__(
        self,
        metrics: GatewayMetrics,
        method: str,
        request: omni_pb2.GenerateRequest | None,
        context: grpc.aio.ServicerContext,
        arrived_at: float,
    ) -> None:
        self.metrics, self.context, self.arrived_at = metrics, context, arrived_at
        self.timed = request is not None
        self.modality = modality_label(request) if request is not None else ""
        remaining = context.time_remaining() if self.timed else None
        self.deadline = None if remaining is None else arrived_at + remaining
        self.tokens = metrics.tokens.labels(metrics.service, method)
        self.audio = metrics.audio_s.labels(metrics.service, method)
        self.first_text = self.timed
        self.spoken = request is not None and omni_pb2.MODALITY_AUDIO in request.output_modalities
        self.finish: omni_pb2.Finish | None = None

    def sent(self, event: omni_pb2.GenerateEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "text":
            if self.first_text:
                self.first_text = False
                elapsed = time.monotonic() - self.arrived_at
                self.metrics.ttft.labels(self.metrics.service, self.modality).observe(elapsed)
            self.tokens.inc(len(event.text.token_ids))
        elif kind == "audio":
            if event.audio.sample_rate_hz:
                self.audio.inc(len(event.audio.pcm16) / 2 / event.audio.sample_rate_hz)
        elif kind == "image":
            self.metrics.images.labels(self.metrics.service).inc()
        elif kind == "finish":
            self.finish = event.finish

    def __enter__(self) -> CallRecord:
        return self

    def __exit__(self, _type: type | None, exc: BaseException | None, _tb: object) -> None:
        m, ended = self.metrics, time.monotonic()
        if exc is not None:
            if isinstance(exc, Overloaded):
                m.refusals.get(exc.reason or "stage", m.refusals["stage"]).inc()
            if self.timed:
                code = status_of(exc, self.context)[0]
                m.e2e.labels(m.service, self.modality, code.name).observe(ended - self.arrived_at)
            return
        if self.timed:
            m.e2e.labels(m.service, self.modality, grpc.StatusCode.OK.name).observe(ended - self.arrived_at)
            done = answer_code(self.finish, spoken=self.spoken) == OK  # the definition `omnistage bench` uses
            if done and (self.deadline is None or ended <= self.deadline):
                m.goodput.labels(m.service, self.modality).inc()
