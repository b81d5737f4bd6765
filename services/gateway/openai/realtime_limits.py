"""Limits and metrics of the Realtime endpoint: how many sessions (in all, per API key), how much audio
one buffer holds, how long a session lives and may stay idle; and what Prometheus sees of it."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

from omnistage.common import metrics
from omnistage.common.config import GatewayConfig


@dataclass(frozen=True)
class RealtimeOptions:
    """The gateway's realtime_* keys (docs/config.md), and the turn limits the Converse call applies
    (a turn over them would end the call, so the session refuses it first)."""

    max_sessions: int = GatewayConfig.realtime_max_sessions
    max_sessions_per_key: int = GatewayConfig.realtime_max_sessions_per_key
    max_buffer_bytes: int = GatewayConfig.realtime_max_buffer_bytes
    max_session_s: float = GatewayConfig.realtime_max_session_s
    idle_timeout_s: float = GatewayConfig.realtime_idle_timeout_s
    max_turn_chars: int = GatewayConfig.converse_max_turn_chars
    max_prompt_chars: int = GatewayConfig.max_prompt_chars
    encode_ahead_ms: int = GatewayConfig.realtime_encode_ahead_ms
    buffer_knob: str = "gateway.realtime_max_buffer_bytes"  # the key that sets max_buffer_bytes

    def buffer_limit(self, max_turn_audio_bytes: int, max_audio_seconds: float) -> RealtimeOptions:
        """These options with the buffer capped by one Converse turn (bytes, and the encoder's longest
        clip at 24 kHz PCM16)."""
        cap, knob = min(
            (self.max_buffer_bytes, "gateway.realtime_max_buffer_bytes"),
            (max_turn_audio_bytes, "gateway.converse_max_turn_audio_bytes"),
            (int(max_audio_seconds * 24000) * 2, "encoder.max_audio_seconds"),
            key=lambda limit: limit[0],
        )
        return dataclasses.replace(self, max_buffer_bytes=cap, buffer_knob=knob)


def key_of(authorization: str) -> str:
    """Who a session counts against: a digest of its credentials (never the key itself)."""
    return hashlib.sha256(authorization.encode("utf-8", "surrogateescape")).hexdigest()[:16]


class SessionSlots:
    """Sessions open, in all and per key; `take` says why not when a limit is reached."""

    def __init__(self, options: RealtimeOptions) -> None:
        self.options = options
        self.per_key: dict[str, int] = {}
        self.total = 0

    def take(self, key: str) -> str:
        o = self.options
        if self.total >= o.max_sessions:
            return f"{o.max_sessions} realtime sessions are open, the most allowed (gateway.realtime_max_sessions)"
        if self.per_key.get(key, 0) >= o.max_sessions_per_key:
            return (
                f"this API key has {o.max_sessions_per_key} realtime sessions open, the most allowed "
                "(gateway.realtime_max_sessions_per_key)"
            )
        self.total += 1
        self.per_key[key] = self.per_key.get(key, 0) + 1
        return ""

    def give(self, key: str) -> None:
        self.total -= 1
        left = self.per_key[key] - 1
        if left:
            self.per_key[key] = left
        else:
            del self.per_key[key]


class RealtimeMetrics:
    """The endpoint's Prometheus series (the TTFA of each spoken answer is the Converse call's, in
    gateway_ttfa_seconds)."""

    def __init__(self, service: str = "gateway") -> None:
        self.service = service
        self._sessions = metrics.gauge("gateway_realtime_sessions", "Realtime WebSocket sessions open")
        self._responses = metrics.gauge(
            "gateway_realtime_responses_active", "Realtime responses being streamed now"
        )
        self._closed = metrics.counter(
            "gateway_realtime_sessions_closed",
            "Realtime sessions ended, by why (client, refused, unauthenticated, session_length, idle, "
            "error, shutdown)",
            ("reason",),
        )
        self._turns = metrics.counter(
            "gateway_realtime_turns",
            "Realtime responses started, by what started them (server_vad, client)",
            ("trigger",),
        )
        self._ends = metrics.counter(
            "gateway_realtime_responses", "Realtime responses ended, by status", ("status",)
        )
        self._barge_ins = metrics.counter(
            "gateway_realtime_barge_ins", "Realtime responses cancelled because the user spoke"
        )
        self._vad = metrics.counter(
            "gateway_realtime_vad_decisions",
            "Server VAD decisions (speech_started, speech_stopped)",
            ("decision",),
        )

    def session_opened(self) -> None:
        self._sessions.labels(self.service).inc()

    def session_closed(self, reason: str) -> None:
        self._sessions.labels(self.service).dec()
        self._closed.labels(self.service, reason).inc()

    def refused(self, reason: str) -> None:
        self._closed.labels(self.service, reason).inc()

    def response_started(self, trigger: str) -> None:
        self._turns.labels(self.service, trigger).inc()
        self._responses.labels(self.service).inc()

    def response_ended(self, status: str) -> None:
        self._responses.labels(self.service).dec()
        self._ends.labels(self.service, status).inc()

    def barge_in(self) -> None:
        self._barge_ins.labels(self.service).inc()

    def vad(self, started: bool) -> None:
        self._vad.labels(self.service, "speech_started" if started else "speech_stopped").inc()
