"""The gateway (`gateway:`): admission, request bounds, speech, stage watch, the HTTP and Realtime fronts."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.config.checks import positive_fields


@dataclass(frozen=True)
class GatewayConfig:
    """Gateway behaviour."""

    # Seconds the gateway waits at start-up for the thinker to be admitted (SERVING + a warm-up
    # through it; then it serves text), and `omnistage serve` for every other capability (speech,
    # media input, image output) before it calls the start-up failed, naming what is missing.
    stage_wait_s: float = 600.0
    # Serve what is ready instead of failing at start-up: the gateway turns SERVING without an
    # admitted thinker, `serve` is ready as soon as the gateway is, and each capability joins when
    # its stages are admitted (health names omnistage.v1.Omni.<capability>).
    allow_degraded: bool = False
    # Requests in flight through the gateway before RESOURCE_EXHAUSTED.
    max_concurrent_requests: int = 256
    # Most messages in one request; counted before anything else is looked at.
    max_messages: int = 256
    # Most content parts in one message; counted before anything else is looked at.
    max_parts_per_message: int = 64
    # Longest prompt in characters: system prompt + every text + the chat markup of each turn (the
    # thinker also checks tokens).
    max_prompt_chars: int = 200_000
    # Default system prompt; empty uses the model's own.
    system_prompt: str = ""
    # Directory Media.path may name files in (real path, symlinks resolved); empty refuses Media.path.
    media_dir: str = ""
    # Speech (a talker is deployed): how long the text waits for the talker to accept a stream's voice,
    # in seconds (a refusal then fails the request naming the field; later, only the speech ends).
    talker_start_wait_s: float = 2.0
    # Speech: how long a spoken answer's audio waits for a free talker stream, in seconds (its text never
    # waits: it streams at once, and the audio joins when a stream frees); past it the answer is text
    # only, its AudioStatus RESOURCE_EXHAUSTED with a retry hint.
    talker_stream_wait_s: float = 5.0
    # How long the talker may stay silent once it has all of an answer's text before the gateway gives
    # up on the speech, in seconds.
    talker_idle_timeout_s: float = 30.0
    # Events (audio chunks, text deltas) of one request waiting for a slow client; a full buffer
    # pauses that request's talker and thinker streams, nobody else's.
    speech_buffer_events: int = 16
    # Omni.Converse: user turns (with their answers) kept in a call's history; the longest text turn in
    # characters; the most PCM16 bytes of one spoken turn.
    converse_max_turns: int = 16
    converse_max_turn_chars: int = 4000
    converse_max_turn_audio_bytes: int = 1_920_000
    # Omni.Converse: encoder outputs of spoken turns kept for the conversation's later turns (each clip
    # encoded once per call; their leases held in the encoder's pool, within a quarter of its
    # transport_pool_bytes), also those a Realtime session encodes ahead; 0: none kept (each turn encodes
    # its window's clips again, after the turn ended).
    converse_kept_encodings: int = 512
    # Stage watch (from start-up on): seconds between health checks of each stage, the deadline of one
    # check in seconds, and the checks in a row not answering SERVING before the stage is marked down
    # (its calls in flight fail with UNAVAILABLE; it is re-admitted when it is SERVING again).
    stage_health_interval_s: float = 1.0
    stage_health_timeout_s: float = 2.0
    stage_health_failures: int = 3
    # Admission by capacity: requests that may wait in the gateway for a slot of the thinker (beyond
    # its max_num_seqs running ones) before RESOURCE_EXHAUSTED, and the service time in seconds
    # assumed until the first request finished (then measured).
    admission_max_waiting: int = 64
    admission_initial_service_s: float = 2.0
    # OpenAI-compatible HTTP front (docs/openai.md) on this port of bind_host; 0 means none. It calls the
    # gateway's own Omni port, so API keys, TLS, validation and admission are those of the gRPC API.
    http_port: int = 0
    # Model id the HTTP front lists in /v1/models and puts in its responses.
    http_model: str = "ming-flash-omni-2.0"
    # Deadline of each HTTP request's Omni call, in seconds.
    http_timeout_s: float = 600.0
    # Largest HTTP request body (JSON with base64 media), in bytes; larger ones get 413. Also the largest
    # /v1/realtime WebSocket message.
    http_max_body_bytes: int = 96 * 1024 * 1024
    # Realtime API (GET /v1/realtime on http_port, docs/openai.md): WebSocket sessions open in all and
    # per API key (one more is accepted, told why in an `error` event and closed with 1013); PCM16
    # bytes the input audio buffer holds (also capped by converse_max_turn_audio_bytes and the
    # encoder's max_audio_seconds at 24 kHz; more clears it with an `error`); the longest session and
    # the longest time without a client event (not counting a response being streamed), in seconds
    # (then an `error` event and close code 1008).
    realtime_max_sessions: int = 64
    realtime_max_sessions_per_key: int = 16
    realtime_max_buffer_bytes: int = 1_920_000
    realtime_max_session_s: float = 1800.0
    realtime_idle_timeout_s: float = 300.0
    # Realtime with server VAD: once the silence after speech has lasted this long (at most half of the
    # session's silence_duration_ms), the turn's audio — its speech and that much silence — goes to the
    # encoder, before VAD calls the speech stopped; speech that resumes drops it. 0 (or
    # converse_kept_encodings 0): encoded when the turn is sent, its audio through the whole silence.
    realtime_encode_ahead_ms: int = 200
    # Accept HTTP bodies with top-level fields OpenAI's schema does not have (they are ignored); off:
    # 400 naming them, as OpenAI answers.
    http_allow_unknown_fields: bool = False

    def validate(self, path: str) -> None:
        positive_fields(
            self,
            path,
            (
                "stage_wait_s",
                "max_concurrent_requests",
                "max_messages",
                "max_parts_per_message",
                "max_prompt_chars",
                "talker_start_wait_s",
                "talker_stream_wait_s",
                "talker_idle_timeout_s",
                "speech_buffer_events",
                "converse_max_turns",
                "converse_max_turn_chars",
                "converse_max_turn_audio_bytes",
                "stage_health_interval_s",
                "stage_health_timeout_s",
                "stage_health_failures",
                "admission_initial_service_s",
                "http_timeout_s",
                "http_max_body_bytes",
                "realtime_max_sessions",
                "realtime_max_sessions_per_key",
                "realtime_max_buffer_bytes",
                "realtime_max_session_s",
                "realtime_idle_timeout_s",
            ),
        )
        positive_fields(self, path, ("converse_kept_encodings", "realtime_encode_ahead_ms"), allow_zero=True)
