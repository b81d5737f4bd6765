"""The typed deploy file: frozen dataclasses loaded strictly from one YAML plus `--set` overrides.

Unknown keys and bad values fail with the key path (`services.thinker.engine.block_size: expected
int > 0, got 'x'`). Every knob is documented in `docs/config.md`; derived numbers (KV blocks, graph
buckets) live in resolved objects of the services, never written back here.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omnistage.common.stages import CAPABILITIES, SERVICE_KINDS


class ConfigError(ValueError):
    """A deploy file that cannot be used; the message names the key path."""


Phase = Literal["starting", "loading_weights", "profiling_memory", "warming_up", "capturing_graphs"]
STARTUP_PHASES: tuple[str, ...] = typing.get_args(Phase)


@dataclass(frozen=True)
class FaultConfig:
    """Test hook: make this service misbehave in one start-up phase (chaos and launcher tests)."""

    phase: Phase = "loading_weights"
    # hang: sleep forever (no progress); crash: exit(3); oom: raise a simulated out-of-memory;
    # delay: sleep `delay_s` then continue normally.
    action: Literal["hang", "crash", "oom", "delay"] = "hang"
    # TP rank that misbehaves; -1 means every rank.
    rank: int = -1
    delay_s: float = 1.0
    # Where inside the phase an `oom` fires; "" means on entering the phase. Thinker only:
    # "kv_rebuild" / "kv_validation" (profiling_memory: a peer takes the device's free memory just
    # before the KV rebuild or the validation stress, so the allocation itself fails),
    # "warmup_forward" (warming_up: an out-of-memory error half-way through the first warm-up forward).
    at: Literal["", "kv_rebuild", "kv_validation", "warmup_forward"] = ""


# The thinker's kernel choices (engine.attention_backend / engine.moe_backend); `auto` takes the
# fastest one the device runs (services/thinker/models/layers/backends.py).
ATTENTION_BACKENDS = ("auto", "torch", "triton")
MOE_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """Thinker engine limits (paged KV cache, continuous batching)."""

    # Tokens per KV block.
    block_size: int = 16
    # KV blocks; 0 means sized automatically (CPU: from max_num_seqs * max_model_len).
    num_kv_blocks: int = 0
    # Requests decoded together in one step.
    max_num_seqs: int = 32
    # Tokens (prefill chunks + decodes) in one step.
    max_num_batched_tokens: int = 512
    # Prompt + output tokens of one request.
    max_model_len: int = 2048
    # Split long prompts into chunks of at most max_num_batched_tokens, mixed with decodes.
    chunked_prefill: bool = True
    # max_tokens when a request gives 0; requests may not exceed max_model_len - prompt.
    default_max_tokens: int = 256
    # Requests waiting beyond the running ones before RESOURCE_EXHAUSTED.
    max_queued_requests: int = 256
    # Reuse the KV blocks of a prompt prefix computed before (same tokens, same media, same
    # positions) instead of computing them again; freed blocks keep their K/V until needed.
    prefix_caching: bool = True
    # KV cache size in tokens; 0 means auto-profile (on a device with a budget), >0 pins it and skips the search.
    kv_tokens: int = 0
    # Multiplier (0, 1] on the KV budget the auto-profile computes (1.0 = use all measured headroom).
    kv_safety_factor: float = 1.0
    # Headroom the auto-profile keeps and proves free after the rebuild by allocating it once.
    kv_canary_bytes: int = 256 * 1024 * 1024
    # KV tokens of the probe cache used while measuring the peak; 0 means chosen by the engine.
    kv_probe_tokens: int = 0
    # Attention kernels: auto | torch (reference) | triton (paged decode + KV writes in Triton).
    attention_backend: str = "auto"
    # Routed-expert kernels: auto | torch (reference, one GEMM pair per expert) | triton (fused MoE).
    moe_backend: str = "auto"
    # Capture decode steps as CUDA graphs at padded batch sizes (CUDA with graph-safe backends only).
    cuda_graphs: bool = True
    # Largest decode batch replayed from a graph; 0 means max_num_seqs (bigger batches run eagerly).
    cuda_graph_max_batch: int = 0


@dataclass(frozen=True)
class TPConfig:
    """Deadlines of a tensor-parallel group (thinker): no rank ever waits for a peer without one."""

    # Deadline of the rendezvous and of every collective during start-up (a slow rank's weight
    # loading is waited for here, so it is long).
    startup_collective_timeout_s: float = 900.0
    # Deadline of every collective while serving (step plan broadcast, the forward's all-reduces);
    # idle workers get a keep-alive plan every quarter of it.
    serving_collective_timeout_s: float = 120.0
    # Once a rank has failed, died or stopped answering, every rank of the group exits within this.
    failure_exit_s: float = 30.0
    # How often each rank writes its heartbeat and reads its peers' (and the group's first failure).
    peer_watch_interval_s: float = 0.5
    # A peer whose heartbeat is this old (or the store host not answering for this long) has
    # stopped answering; a dead peer process on the same host is seen within one interval.
    peer_timeout_s: float = 10.0


@dataclass(frozen=True)
class MemoryConfig:
    """Device-memory budget of one service (per TP rank, on the device that rank runs on)."""

    # Bytes this service may hold on its device; 0 means no byte budget.
    budget_bytes: int = 0
    # Fraction (0, 1] of its device's total memory; 0 means none. At most one of the two is set.
    budget_fraction: float = 0.0
    # CPU only: account memory against a simulated device of this many bytes (CI); 0 turns it off.
    simulated_capacity_bytes: int = 0

    @property
    def has_budget(self) -> bool:
        return self.budget_bytes > 0 or self.budget_fraction > 0

    def budget_of(self, device_total: int) -> int:
        """The budget in bytes on a device of `device_total` bytes (0 when none is set)."""
        if self.budget_bytes:
            return self.budget_bytes
        return int(self.budget_fraction * device_total)


@dataclass(frozen=True)
class MpsConfig:
    """CUDA MPS, so that stage processes sharing a GPU run their kernels side by side (common/mps.py)."""

    # "auto": a daemon when a GPU hosts more than one stage process, else none; a daemon that cannot
    # start is a warning (the stages time-slice the GPU as without MPS). "on": a daemon for any CUDA
    # stage, and `serve` fails when it cannot start. "off": never.
    mode: Literal["auto", "on", "off"] = "auto"
    # The control program (PATH is searched).
    control_binary: str = "nvidia-cuda-mps-control"
    # How long the daemon may take to open its control pipe, and to quit at the end, in seconds.
    start_timeout_s: float = 30.0
    stop_timeout_s: float = 30.0


@dataclass(frozen=True)
class DevicesConfig:
    """The GPUs of the host, as the launcher's memory ledger sees them."""

    # Bytes of every GPU left out of all budgets (CUDA contexts, NCCL, fragmentation).
    reserve_bytes: int = 0
    # Total bytes of each GPU used by the ledger instead of what the driver reports; 0 asks torch.cuda.
    total_bytes_override: int = 0
    mps: MpsConfig = field(default_factory=MpsConfig)


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
    # Accept HTTP bodies with top-level fields OpenAI's schema does not have (they are ignored); off:
    # 400 naming them, as OpenAI answers.
    http_allow_unknown_fields: bool = False


@dataclass(frozen=True)
class EncoderConfig:
    """Encoder service limits: what one item may be, what one request may hold, how batches are sized."""

    # Smallest / largest pixels of an image after smart_resize (the model's 4·32·32 and 16384·32·32).
    image_min_pixels: int = 4096
    image_max_pixels: int = 16_777_216
    # Largest decoded image or video frame accepted (width × height, checked before decoding).
    max_input_image_pixels: int = 67_108_864
    # Video: smallest pixels of a frame and the pixel budget of all sampled frames (128·32·32, 96·128·32·32).
    video_min_pixels: int = 131_072
    video_total_pixels: int = 12_582_912
    # Video: most frames sampled (or given as frames) per video; an even number.
    max_video_frames: int = 256
    # Longest video accepted, in seconds.
    max_video_seconds: float = 600.0
    # Longest audio clip accepted, in seconds (also capped by the checkpoint: 2·n_ctx / 100 s).
    max_audio_seconds: float = 300.0
    # Items one Encode request may carry.
    max_items_per_request: int = 16
    # Batch sizes (items per forward, per modality) the start-up stress tries, largest first; the
    # largest that fits at the largest item size is the cap.
    stress_batch_sizes: tuple[int, ...] = (8, 4, 2, 1)
    # How long an item waits for a batch slot before RESOURCE_EXHAUSTED, in seconds.
    queue_timeout_s: float = 30.0
    # Threads decoding and preprocessing media.
    preprocess_workers: int = 2
    # Bytes of the producer-owned shared-memory pool (POSIX shm; also the CUDA IPC pool on a GPU).
    transport_pool_bytes: int = 1 << 30
    # Seconds a consumer has to decode an embedding ref before its slice may be reused.
    lease_ttl_s: float = 60.0
    # Embeddings smaller than this many bytes travel inline in the response; larger ones through shm.
    inline_max_bytes: int = 64 * 1024


@dataclass(frozen=True)
class TalkerConfig:
    """Talker service limits: voices, text, segment lengths, sampling, how many streams speak at once."""

    # Preset voice (talker/data/voice_name.json) of a stream that names none.
    default_voice: str = "DB30"
    # Most characters of text one Speak stream may send in total.
    max_text_chars: int = 4000
    # Longest / shortest custom-voice reference clip, in seconds; longest transcript, in characters.
    max_reference_seconds: float = 20.0
    max_transcript_chars: int = 500
    # Longest segment in "semantic" units (CJK characters + English words): the reference's 50.
    max_segment_length: int = 50
    # Pieces (words, CJK characters, spaces, marks) a segment needs before a mark may end it: the
    # first segment at any clause or sentence mark, later ones at sentence marks.
    first_segment_min_pieces: int = 8
    segment_min_pieces: int = 8
    # The first segment's bound, so that the first audio never waits for punctuation: it is cut at a
    # word boundary once it holds this many words (CJK characters, English words, numbers; 0: no bound)
    # or once this many seconds have passed since its first text (0: no time limit), whichever comes
    # first. Later segments keep the reference's rules.
    first_segment_max_pieces: int = 6
    first_segment_max_wait_s: float = 0.25
    # Pace each stream to real time plus this lead, in seconds of audio, instead of racing ahead of
    # its listener (a talker sharing a GPU then leaves the thinker its time); 0: as fast as it goes.
    realtime_lead_s: float = 0.0
    # Longest audio of one segment, in seconds (bounds the VAE cache; the reference also caps each
    # segment at max(2 s, 0.36 s per character)).
    max_segment_seconds: float = 60.0
    # Talker steps before the stop head may end a segment (the reference's 10).
    min_steps: int = 10
    # Positions of the talker LM's KV cache per stream: prompt + one per step (the reference's 2048).
    max_lm_tokens: int = 2048
    # Flow-matching noise temperature; 0 is the reference's pure Euler sampling.
    temperature: float = 0.0
    # Scale of that noise (σ, the reference's 0.25).
    sigma: float = 0.25
    # Hold back trailing silence of each segment (keep at most 0.3 s), as the reference does.
    trim_silence: bool = True
    # Seed of the preset voices' latent samples (computed once at start-up).
    voice_seed: int = 0
    # Streams speaking at once that the start-up stress tries, largest first; the largest that fits
    # is the cap.
    stress_batch_sizes: tuple[int, ...] = (16, 8, 4, 2, 1)
    # How long a new stream waits for a free slot before RESOURCE_EXHAUSTED, in seconds (0: at once).
    queue_timeout_s: float = 0.0
    # onnxruntime threads of the CAM++ speaker model.
    speaker_threads: int = 2
    # Run the LM decode, the CFM sample and the VAE backbone of each step as CUDA graphs at padded sizes, captured
    # at start-up (the stress counts their memory); ignored off CUDA.
    cuda_graphs: bool = True


@dataclass(frozen=True)
class ImageGenConfig:
    """Image-generation service limits: sizes, steps, guidance, how many requests denoise together."""

    # Resolution bucket table the DiT generates at: 512, 672 or 1024 (the model's; 1:1 → highres²).
    highres: int = 1024
    # Smallest / largest width or height a request may ask for, in pixels (multiples of 16).
    min_side_px: int = 64
    max_side_px: int = 2048
    # Width and height of a request that gives 0.
    default_side_px: int = 1024
    # Denoising steps of a request that leaves them unset, and the most it may ask for.
    default_steps: int = 30
    max_steps: int = 100
    # Guidance scale of a request that leaves it unset, and the largest accepted.
    default_guidance_scale: float = 2.0
    max_guidance_scale: float = 20.0
    # Accept reference images (edits); the start-up stress then includes the reference frame.
    allow_edits: bool = True
    # Largest reference image accepted, width × height as its header says (checked before decoding).
    max_reference_pixels: int = 67_108_864
    # Concurrent requests (one DiT forward) the start-up stress tries, largest first, at the largest
    # bucket with guidance (and a reference frame with allow_edits); the largest that fits is the cap.
    stress_batch_sizes: tuple[int, ...] = (8, 4, 2, 1)
    # Requests waiting for a slot beyond the running ones before RESOURCE_EXHAUSTED.
    max_queued_requests: int = 64
    # How long a request waits for a slot before RESOURCE_EXHAUSTED, in seconds.
    queue_timeout_s: float = 60.0
    # Threads decoding conditioning and reference images and encoding PNGs.
    postprocess_workers: int = 2
    # First-block cache threshold (0: off, the exact forward): a denoising step whose first DiT layer's
    # residual changed by less than this (relative mean) since the last full step reuses the rest.
    first_block_cache: float = 0.0


@dataclass(frozen=True)
class TlsConfig:
    """TLS of a service's main port (the gateway's public port)."""

    # PEM certificate chain of the server (required).
    cert_file: str = ""
    # PEM private key of cert_file (required).
    key_file: str = ""
    # PEM CA bundle that signs client certificates; set, clients must present one (mutual TLS).
    client_ca_file: str = ""


# The kinds of service (common/stages.py, the one table of them).
ServiceKind = Literal[SERVICE_KINDS]  # type: ignore[valid-type]


@dataclass(frozen=True)
class ServiceConfig:
    """One service (a stage or the gateway): one process, or one per TP rank."""

    name: str = ""
    kind: ServiceKind = "thinker"
    # gRPC port of the service's API (rank 0 for TP stages).
    port: int = 0
    # Address the main port binds; 0.0.0.0 serves every interface (the gateway, for outside clients).
    bind_host: str = "127.0.0.1"
    # Port of Control (Describe, Drain, Resume) + health + reflection; 0 means no admin port.
    admin_port: int = 0
    # Address the admin port binds.
    admin_host: str = "127.0.0.1"
    # Environment variable holding the admin API key; empty means Control needs no key.
    admin_api_key_env: str = ""
    # TLS of the main port; none means plaintext.
    tls: TlsConfig | None = None
    # Environment variable holding the API keys (comma-separated) of the public API; empty: none.
    api_keys_env: str = ""
    # File of API keys of the public API, one per line ('#' starts a comment); empty: none.
    api_keys_file: str = ""
    # Prometheus /metrics HTTP port; 0 disables it.
    metrics_port: int = 0
    # "cpu" or "cuda".
    device: Literal["cpu", "cuda"] = "cpu"
    # GPU indices, one per TP rank (ignored on CPU).
    gpus: tuple[int, ...] = ()
    # Tensor-parallel ranks (thinker).
    tp_size: int = 1
    # Port of the torch.distributed rendezvous of the TP group.
    dist_port: int = 0
    # Weights and activations dtype.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # Under CUDA MPS (devices.mps), the percentage of each GPU's SMs this service's kernels may use
    # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); 0: no limit.
    mps_active_thread_percentage: int = 0
    # Under CUDA MPS, the scheduling priority of this service's kernels against the other clients on
    # its GPU (CUDA_MPS_CLIENT_PRIORITY): "below_normal" lets a co-located stage yield to the thinker.
    mps_client_priority: Literal["normal", "below_normal"] = "normal"
    # Largest gRPC message in either direction, in bytes.
    max_message_bytes: int = 64 * 1024 * 1024
    # Seconds in-flight requests get to finish after SIGTERM / Drain.
    drain_grace_s: float = 10.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Encoder limits (kind encoder only).
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    # Talker limits (kind talker only).
    talker: TalkerConfig = field(default_factory=TalkerConfig)
    # Image-generation limits (kind imagegen only).
    imagegen: ImageGenConfig = field(default_factory=ImageGenConfig)
    # Test hook only; never set in production files.
    fault: FaultConfig | None = None


@dataclass(frozen=True)
class StartupConfig:
    """Deadlines of start-up: every wait has one (a lost 'ready' must never hang the launcher)."""

    # Longest time a service may spend in each phase, in seconds.
    phase_deadlines_s: dict[str, float] = field(
        default_factory=lambda: {
            "starting": 60.0,
            "loading_weights": 900.0,
            "profiling_memory": 600.0,
            "warming_up": 600.0,
            "capturing_graphs": 600.0,
        }
    )
    # A start-up phase whose progress heartbeat is older than this is reported stuck (after ready:
    # supervision.heartbeat_timeout_s).
    heartbeat_timeout_s: float = 120.0
    # Launcher poll period of each service's Describe.
    poll_interval_s: float = 0.2
    # Deadline of one Describe/health call.
    rpc_timeout_s: float = 2.0
    # SIGTERM → SIGKILL grace when the launcher stops children.
    stop_grace_s: float = 15.0


@dataclass(frozen=True)
class SupervisionConfig:
    """After start-up: how a hung or dead service is noticed and restarted instead of ending `serve`."""

    # How often each process writes its liveness heartbeat into its status file (from its event
    # loop: a stopped or stuck loop stops it).
    heartbeat_interval_s: float = 1.0
    # A ready process whose heartbeat (or health answer, rank 0) is older than this is hung.
    heartbeat_timeout_s: float = 10.0
    # How often the launcher asks each ready service's health (non-blocking, deadline rpc_timeout_s).
    health_interval_s: float = 2.0
    # Restarts of one service within restart_window_s; one more failure stops everything (exit 1).
    # 0: never restart (the first failure after ready ends `serve`).
    max_restarts: int = 5
    restart_window_s: float = 600.0
    # Delay before restart k (1-based) within the window: backoff_initial_s * 2^(k-1), capped.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0


@dataclass(frozen=True)
class ModelConfig:
    """The checkpoint served."""

    # Directory of the HF-layout checkpoint (relative paths are relative to the working directory).
    checkpoint: str = ".cache/tiny-ming"
    # "safetensors": read the weights; "dummy": random weights in the real shapes and dtype, made on
    # the device (benchmarks; the directory needs only config.json and the tokenizer).
    load_format: Literal["safetensors", "dummy"] = "safetensors"


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def join_host_port(host: str, port: int) -> str:
    """`127.0.0.1:7151`, `[::1]:7151`: the form gRPC targets and bind addresses take."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


# Public capabilities and the stage kinds each needs (common/stages.py): the gateway serves each one as
# soon as its stages are admitted (health names `omnistage.v1.Omni.<capability>`, Describe.readiness),
# and the launcher's "ready" waits for all of them.
CAPABILITY_HEALTH_PREFIX = "omnistage.v1.Omni."


@dataclass(frozen=True)
class DeployConfig:
    """A whole deployment on one host."""

    version: int = 1
    # Address of this host: services bound to a wildcard address are dialed here; /metrics and the
    # TP rendezvous bind here.
    host: str = "127.0.0.1"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    # Log format: "text" for people, "json" for collectors.
    log_format: Literal["text", "json"] = "text"
    model: ModelConfig = field(default_factory=ModelConfig)
    startup: StartupConfig = field(default_factory=StartupConfig)
    supervision: SupervisionConfig = field(default_factory=SupervisionConfig)
    devices: DevicesConfig = field(default_factory=DevicesConfig)
    # Services by name; the name is also the key here.
    services: dict[str, ServiceConfig] = field(default_factory=dict)

    def service(self, name: str) -> ServiceConfig:
        if name not in self.services:
            raise ConfigError(f"services.{name}: no such service (have: {', '.join(self.services)})")
        return self.services[name]

    def services_of(self, kind: str) -> list[ServiceConfig]:
        return [s for s in self.services.values() if s.kind == kind]

    def capabilities(self) -> list[str]:
        """The public capabilities this deploy file serves: those whose stage kinds are all deployed."""
        deployed = {s.kind for s in self.services.values()}
        return [name for name, kinds in CAPABILITIES.items() if set(kinds) <= deployed]

    def dial_host(self, bind_host: str) -> str:
        """Where a server bound to `bind_host` is reached: that address, or `host` for a wildcard."""
        return self.host if bind_host in WILDCARD_HOSTS else bind_host

    def address(self, name: str) -> str:
        """HOST:PORT of a service's main port (its API), as other processes dial it."""
        svc = self.service(name)
        return join_host_port(self.dial_host(svc.bind_host), svc.port)

    def admin_address(self, name: str) -> str:
        """HOST:PORT of a service's admin port (Control), or '' when it has none."""
        svc = self.service(name)
        return join_host_port(self.dial_host(svc.admin_host), svc.admin_port) if svc.admin_port else ""


# ---------------------------------------------------------------------------------------------
# Strict loading


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type, or fail naming the key path."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(value, non_none[0], path)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in args:
            raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        ktype, vtype = args
        return {_convert(k, ktype, f"{path}"): _convert(v, vtype, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key (known keys{' of ' + path if path else ''}: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{path}.{name}" if path else name)
    return cls(**kwargs)


def _positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: expected {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def _validate(cfg: DeployConfig) -> DeployConfig:
    if cfg.version != 1:
        raise ConfigError(f"version: expected 1, got {cfg.version}")
    _validate_startup(cfg.startup)
    _validate_supervision(cfg.supervision)
    for key in ("reserve_bytes", "total_bytes_override"):
        _positive(f"devices.{key}", getattr(cfg.devices, key), allow_zero=True)
    for key in ("start_timeout_s", "stop_timeout_s"):
        _positive(f"devices.mps.{key}", getattr(cfg.devices.mps, key))
    ports: dict[int, str] = {}
    services = {}
    for name, svc in cfg.services.items():
        p = f"services.{name}"
        if svc.name and svc.name != name:
            raise ConfigError(f"{p}.name: must equal the key {name!r}, got {svc.name!r}")
        svc = dataclasses.replace(svc, name=name)
        _claim_ports(p, svc, ports)
        _validate_service(p, svc)
        services[name] = svc
    gateways = [n for n, s in services.items() if s.kind == "gateway"]
    if len(gateways) > 1:
        raise ConfigError(f"services: at most one gateway, got {', '.join(gateways)}")
    return dataclasses.replace(cfg, services=services)


def _validate_startup(st: StartupConfig) -> None:
    for key in ("heartbeat_timeout_s", "poll_interval_s", "rpc_timeout_s"):
        _positive(f"startup.{key}", getattr(st, key))
    _positive("startup.stop_grace_s", st.stop_grace_s, allow_zero=True)
    for phase in st.phase_deadlines_s:
        if phase not in STARTUP_PHASES:
            raise ConfigError(
                f"startup.phase_deadlines_s.{phase}: unknown phase (known: {', '.join(STARTUP_PHASES)})"
            )
    for phase, value in st.phase_deadlines_s.items():
        _positive(f"startup.phase_deadlines_s.{phase}", value)


def _validate_supervision(sv: SupervisionConfig) -> None:
    for key in (
        "heartbeat_interval_s",
        "heartbeat_timeout_s",
        "health_interval_s",
        "restart_window_s",
        "backoff_max_s",
    ):
        _positive(f"supervision.{key}", getattr(sv, key))
    for key in ("max_restarts", "backoff_initial_s"):
        _positive(f"supervision.{key}", getattr(sv, key), allow_zero=True)
    if sv.heartbeat_interval_s >= sv.heartbeat_timeout_s:
        raise ConfigError(
            f"supervision.heartbeat_interval_s: must be below heartbeat_timeout_s "
            f"({sv.heartbeat_timeout_s:g}), got {sv.heartbeat_interval_s:g}"
        )


def _claim_ports(p: str, svc: ServiceConfig, ports: dict[int, str]) -> None:
    """Check the ports of `svc` and record them in `ports` (port → key); a clash names both keys."""
    for key in ("port", "admin_port", "metrics_port", "dist_port", "gateway.http_port"):
        port = svc.gateway.http_port if key == "gateway.http_port" else getattr(svc, key)
        if port == 0 and key == "port":
            raise ConfigError(f"{p}.port: required")
        if not 0 <= port < 65536:
            raise ConfigError(f"{p}.{key}: expected a port number, got {port}")
        if port:
            ports_needed = svc.tp_size if key == "dist_port" else 1
            for q in range(port, port + ports_needed):
                if q in ports:
                    raise ConfigError(f"{p}.{key}: port {q} is also used by {ports[q]}")
                ports[q] = f"{p}.{key}"


def _validate_service(p: str, svc: ServiceConfig) -> None:
    _positive(f"{p}.tp_size", svc.tp_size)
    _positive(f"{p}.max_message_bytes", svc.max_message_bytes)
    _positive(f"{p}.drain_grace_s", svc.drain_grace_s, allow_zero=True)
    if not 0 <= svc.mps_active_thread_percentage <= 100:
        raise ConfigError(
            f"{p}.mps_active_thread_percentage: expected 0 (no limit) to 100, "
            f"got {svc.mps_active_thread_percentage}"
        )
    if svc.fault is not None:
        if not -1 <= svc.fault.rank < svc.tp_size:
            raise ConfigError(
                f"{p}.fault.rank: expected -1 (every rank) or 0..{svc.tp_size - 1}, got {svc.fault.rank}"
            )
        _positive(f"{p}.fault.delay_s", svc.fault.delay_s, allow_zero=True)
        _validate_fault_point(p, svc)
    if svc.tp_size > 1 and svc.dist_port == 0:
        raise ConfigError(f"{p}.dist_port: required when tp_size > 1")
    if svc.device == "cuda" and svc.gpus and len(svc.gpus) != svc.tp_size:
        raise ConfigError(
            f"{p}.gpus: expected {svc.tp_size} GPU indices (one per rank), got {list(svc.gpus)}"
        )
    _validate_engine(p, svc.engine)
    _validate_memory(p, svc)
    _validate_encoder(p, svc.encoder)
    _validate_talker(p, svc.talker)
    _validate_imagegen(p, svc.imagegen)
    _validate_access(p, svc)
    _validate_tp(p, svc.tp)
    _validate_gateway(p, svc.gateway)
    e = svc.engine
    if not e.chunked_prefill and e.max_num_batched_tokens < e.max_model_len:
        raise ConfigError(
            f"{p}.engine.max_num_batched_tokens: must be >= max_model_len ({e.max_model_len}) "
            "when chunked_prefill is false"
        )


def _validate_engine(p: str, e: EngineConfig) -> None:
    for key in (
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "default_max_tokens",
    ):
        _positive(f"{p}.engine.{key}", getattr(e, key))
    for key in (
        "num_kv_blocks",
        "max_queued_requests",
        "kv_tokens",
        "kv_canary_bytes",
        "kv_probe_tokens",
        "cuda_graph_max_batch",
    ):
        _positive(f"{p}.engine.{key}", getattr(e, key), allow_zero=True)
    for key, allowed in (("attention_backend", ATTENTION_BACKENDS), ("moe_backend", MOE_BACKENDS)):
        if getattr(e, key) not in allowed:
            raise ConfigError(
                f"{p}.engine.{key}: expected one of {', '.join(allowed)}, got {getattr(e, key)!r}"
            )
    if not 0 < e.kv_safety_factor <= 1:
        raise ConfigError(
            f"{p}.engine.kv_safety_factor: expected a number in (0, 1], got {e.kv_safety_factor}"
        )
    if e.kv_tokens and e.num_kv_blocks:
        raise ConfigError(f"{p}.engine.kv_tokens: set kv_tokens or num_kv_blocks, not both")


def _validate_gateway(p: str, g: GatewayConfig) -> None:
    for key in (
        "stage_wait_s",
        "max_concurrent_requests",
        "max_messages",
        "max_parts_per_message",
        "max_prompt_chars",
        "talker_start_wait_s",
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
    ):
        _positive(f"{p}.gateway.{key}", getattr(g, key))


def _validate_access(p: str, svc: ServiceConfig) -> None:
    """Bind addresses, admin port, TLS, API keys: secrets are named (env var, file), never inline."""
    for key in ("bind_host", "admin_host"):
        if not getattr(svc, key).strip():
            raise ConfigError(f"{p}.{key}: expected an address (127.0.0.1, 0.0.0.0, ...), got ''")
    if svc.admin_api_key_env and not svc.admin_port:
        raise ConfigError(f"{p}.admin_api_key_env: set admin_port too (the key protects the admin port)")
    public = {
        "tls": svc.tls is not None,
        "api_keys_env": bool(svc.api_keys_env),
        "api_keys_file": bool(svc.api_keys_file),
        "gateway.media_dir": bool(svc.gateway.media_dir),
        "gateway.http_port": bool(svc.gateway.http_port),
    }
    for key, is_set in public.items():
        if is_set and svc.kind != "gateway":
            raise ConfigError(f"{p}.{key}: only the gateway serves clients from outside (kind is {svc.kind})")
    if svc.tls is not None:
        for key in ("cert_file", "key_file"):
            if not getattr(svc.tls, key):
                raise ConfigError(f"{p}.tls.{key}: required when tls is set")
        if not svc.admin_port:
            raise ConfigError(f"{p}.admin_port: required when tls is set (the launcher checks health there)")
        if svc.tls.client_ca_file and svc.gateway.http_port:
            raise ConfigError(
                f"{p}.gateway.http_port: not with tls.client_ca_file (the HTTP front calls the "
                "Omni port and has no client certificate of its own)"
            )


_FAULT_POINT_PHASES = {
    "kv_rebuild": "profiling_memory",
    "kv_validation": "profiling_memory",
    "warmup_forward": "warming_up",
}


def _validate_fault_point(p: str, svc: ServiceConfig) -> None:
    f = svc.fault
    if f is None or not f.at:
        return
    if svc.kind != "thinker" or f.action != "oom":
        raise ConfigError(f"{p}.fault.at: only for action oom of a thinker (got {f.action} of a {svc.kind})")
    if f.phase != _FAULT_POINT_PHASES[f.at]:
        raise ConfigError(f"{p}.fault.at: {f.at} happens in phase {_FAULT_POINT_PHASES[f.at]}, not {f.phase}")


def _validate_tp(p: str, tp: TPConfig) -> None:
    for key in (
        "startup_collective_timeout_s",
        "serving_collective_timeout_s",
        "failure_exit_s",
        "peer_watch_interval_s",
        "peer_timeout_s",
    ):
        _positive(f"{p}.tp.{key}", getattr(tp, key))
    if tp.peer_timeout_s < 2 * tp.peer_watch_interval_s:
        raise ConfigError(
            f"{p}.tp.peer_timeout_s: must be at least twice peer_watch_interval_s ({tp.peer_watch_interval_s:g}), "
            f"got {tp.peer_timeout_s:g}"
        )
    if tp.failure_exit_s < tp.peer_timeout_s + 2 * tp.peer_watch_interval_s:
        raise ConfigError(
            f"{p}.tp.failure_exit_s: must leave time after a silent peer is detected: at least peer_timeout_s "
            f"+ 2 x peer_watch_interval_s ({tp.peer_timeout_s + 2 * tp.peer_watch_interval_s:g}), got {tp.failure_exit_s:g}"
        )


def _validate_memory(p: str, svc: ServiceConfig) -> None:
    m = svc.memory
    for key in ("budget_bytes", "simulated_capacity_bytes"):
        _positive(f"{p}.memory.{key}", getattr(m, key), allow_zero=True)
    if not 0 <= m.budget_fraction <= 1:
        raise ConfigError(f"{p}.memory.budget_fraction: expected a number in [0, 1], got {m.budget_fraction}")
    if m.budget_bytes and m.budget_fraction:
        raise ConfigError(f"{p}.memory.budget_bytes: set budget_bytes or budget_fraction, not both")
    if m.simulated_capacity_bytes and svc.device != "cpu":
        raise ConfigError(
            f"{p}.memory.simulated_capacity_bytes: only for device cpu (got device {svc.device})"
        )
    if m.has_budget and svc.device == "cpu" and not m.simulated_capacity_bytes:
        raise ConfigError(f"{p}.memory: a budget on device cpu needs simulated_capacity_bytes > 0")
    if m.budget_bytes and m.simulated_capacity_bytes and m.budget_bytes > m.simulated_capacity_bytes:
        raise ConfigError(
            f"{p}.memory.budget_bytes: {m.budget_bytes} exceeds simulated_capacity_bytes {m.simulated_capacity_bytes}"
        )
    if any(g < 0 for g in svc.gpus):
        raise ConfigError(f"{p}.gpus: expected GPU indices >= 0, got {list(svc.gpus)}")
    if svc.device == "cpu" and m.simulated_capacity_bytes and svc.gpus and len(svc.gpus) != svc.tp_size:
        raise ConfigError(
            f"{p}.gpus: expected {svc.tp_size} simulated GPU indices (one per rank), got {list(svc.gpus)}"
        )


def _validate_encoder(p: str, e: EncoderConfig) -> None:
    q = f"{p}.encoder"
    for key in (
        "image_min_pixels",
        "image_max_pixels",
        "max_input_image_pixels",
        "video_min_pixels",
        "video_total_pixels",
        "max_video_frames",
        "max_video_seconds",
        "max_audio_seconds",
        "max_items_per_request",
        "queue_timeout_s",
        "preprocess_workers",
        "transport_pool_bytes",
        "lease_ttl_s",
    ):
        _positive(f"{q}.{key}", getattr(e, key))
    _positive(f"{q}.inline_max_bytes", e.inline_max_bytes, allow_zero=True)
    if e.image_min_pixels > e.image_max_pixels:
        raise ConfigError(
            f"{q}.image_min_pixels: {e.image_min_pixels} exceeds image_max_pixels {e.image_max_pixels}"
        )
    if e.max_video_frames % 2:
        raise ConfigError(f"{q}.max_video_frames: expected an even number, got {e.max_video_frames}")
    if not e.stress_batch_sizes or any(b < 1 for b in e.stress_batch_sizes):
        raise ConfigError(
            f"{q}.stress_batch_sizes: expected batch sizes >= 1, got {list(e.stress_batch_sizes)}"
        )


def _validate_talker(p: str, t: TalkerConfig) -> None:
    q = f"{p}.talker"
    for key in (
        "max_text_chars",
        "max_reference_seconds",
        "max_transcript_chars",
        "max_segment_length",
        "first_segment_min_pieces",
        "segment_min_pieces",
        "max_segment_seconds",
        "max_lm_tokens",
        "speaker_threads",
    ):
        _positive(f"{q}.{key}", getattr(t, key))
    for key in (
        "min_steps",
        "temperature",
        "sigma",
        "queue_timeout_s",
        "voice_seed",
        "first_segment_max_pieces",
        "first_segment_max_wait_s",
        "realtime_lead_s",
    ):
        _positive(f"{q}.{key}", getattr(t, key), allow_zero=True)
    if not t.default_voice.strip():
        raise ConfigError(f"{q}.default_voice: expected a preset voice name, got ''")
    if not t.stress_batch_sizes or any(b < 1 for b in t.stress_batch_sizes):
        raise ConfigError(
            f"{q}.stress_batch_sizes: expected batch sizes >= 1, got {list(t.stress_batch_sizes)}"
        )


IMAGE_SIZE_MULTIPLE = 16  # the Z-Image VAE's 8x times the DiT's 2x2 patch


def _validate_imagegen(p: str, g: ImageGenConfig) -> None:
    q = f"{p}.imagegen"
    if g.highres not in (512, 672, 1024):
        raise ConfigError(
            f"{q}.highres: expected 512, 672 or 1024 (the model's bucket tables), got {g.highres}"
        )
    for key in (
        "min_side_px",
        "max_side_px",
        "default_side_px",
        "default_steps",
        "max_steps",
        "max_reference_pixels",
        "queue_timeout_s",
        "postprocess_workers",
    ):
        _positive(f"{q}.{key}", getattr(g, key))
    _positive(f"{q}.max_queued_requests", g.max_queued_requests, allow_zero=True)
    _positive(f"{q}.first_block_cache", g.first_block_cache, allow_zero=True)
    for key in ("min_side_px", "max_side_px", "default_side_px"):
        if getattr(g, key) % IMAGE_SIZE_MULTIPLE:
            raise ConfigError(
                f"{q}.{key}: expected a multiple of {IMAGE_SIZE_MULTIPLE}, got {getattr(g, key)}"
            )
    if not g.min_side_px <= g.default_side_px <= g.max_side_px:
        raise ConfigError(
            f"{q}.default_side_px: {g.default_side_px} is outside [min_side_px {g.min_side_px}, "
            f"max_side_px {g.max_side_px}]"
        )
    if g.default_steps > g.max_steps:
        raise ConfigError(f"{q}.default_steps: {g.default_steps} exceeds max_steps {g.max_steps}")
    if not (math.isfinite(g.max_guidance_scale) and g.max_guidance_scale >= 0):
        raise ConfigError(
            f"{q}.max_guidance_scale: expected a finite number >= 0, got {g.max_guidance_scale}"
        )
    if not 0 <= g.default_guidance_scale <= g.max_guidance_scale:
        raise ConfigError(
            f"{q}.default_guidance_scale: expected 0..max_guidance_scale ({g.max_guidance_scale}), "
            f"got {g.default_guidance_scale}"
        )
    if not g.stress_batch_sizes or any(b < 1 for b in g.stress_batch_sizes):
        raise ConfigError(
            f"{q}.stress_batch_sizes: expected batch sizes >= 1, got {list(g.stress_batch_sizes)}"
        )


def parse_override(text: str) -> tuple[list[str], Any]:
    """`services.thinker.tp_size=2` → (['services','thinker','tp_size'], 2); the value is YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if overrides and not isinstance(data, dict):
        raise ConfigError("deploy file: expected a mapping at the top level")
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:  # absent, or an empty YAML section (`startup:`)
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(keys[: i + 1])} is not a mapping")
        node[keys[-1]] = value
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> DeployConfig:
    """Load and validate a deploy file; `overrides` are `KEY.PATH=VALUE` strings (CLI `--set`)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such deploy file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return config_from_dict(apply_overrides(data, list(overrides or [])))


def config_from_dict(data: dict[str, Any]) -> DeployConfig:
    if not isinstance(data, dict):
        raise ConfigError("deploy file: expected a mapping at the top level")
    return _validate(_build(DeployConfig, data, ""))


def config_to_dict(cfg: Any) -> Any:
    return dataclasses.asdict(cfg)


def config_hash(obj: Any) -> str:
    """SHA-256 of a config (or part of one): ranks and restarts with different configs show here."""
    blob = json.dumps(config_to_dict(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
