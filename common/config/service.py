"""One service (`services.<name>:`): its process, ports, access, and one section per part it runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

from omnistage.common.config.checks import ConfigError, positive
from omnistage.common.config.encoder import EncoderConfig
from omnistage.common.config.engine import EngineConfig
from omnistage.common.config.gateway import GatewayConfig
from omnistage.common.config.imagegen import ImageGenConfig
from omnistage.common.config.memory import MemoryConfig
from omnistage.common.config.startup import FaultConfig
from omnistage.common.config.talker import TalkerConfig
from omnistage.common.config.tls import TlsConfig
from omnistage.common.config.tp import TPConfig
from omnistage.common.stages import MODEL_KINDS, SERVICE_KINDS

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
    # Least seconds between two memory trims (malloc_trim after a large request; each costs a pass over
    # the heap).
    memory_trim_interval_s: float = 10.0
    engine: EngineConfig = field(default_factory=EngineConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    # Each model stage's own limits, under the key of its kind (a new stage: its module in
    # common/config/ and its row here; STAGE_SECTIONS below finds it through common/stages.py).
    # Encoder limits (kind encoder only).
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    # Talker limits (kind talker only).
    talker: TalkerConfig = field(default_factory=TalkerConfig)
    # Image-generation limits (kind imagegen only).
    imagegen: ImageGenConfig = field(default_factory=ImageGenConfig)
    # Test hook only; never set in production files.
    fault: FaultConfig | None = None

    def gpu_of(self, rank: int) -> int:
        """The GPU index of TP rank `rank`: `gpus[rank]`, or `rank` when `gpus` is not given (the one
        rank → GPU rule: the boot, the memory ledger and the MPS plan read it here)."""
        return self.gpus[rank] if self.gpus else rank

    def device_of(self, rank: int) -> str:
        """The torch device of TP rank `rank`: "cpu", or "cuda:<gpu_of(rank)>"."""
        return "cpu" if self.device == "cpu" else f"cuda:{self.gpu_of(rank)}"

    def validate(self, p: str) -> None:
        """Every key of this service, named under `p` (`services.<name>`); the first problem raises."""
        self._validate_process(p)
        self.engine.validate(f"{p}.engine")
        self.memory.validate(f"{p}.memory", self.device)
        self._validate_gpus(p)
        for kind in STAGE_SECTIONS:
            getattr(self, kind).validate(f"{p}.{kind}")
        self._validate_access(p)
        self.tp.validate(f"{p}.tp")
        self.gateway.validate(f"{p}.gateway")

    def claim_ports(self, p: str, ports: dict[int, str]) -> None:
        """Check this service's ports and record them in `ports` (port → key); a clash names both keys."""
        for key in ("port", "admin_port", "metrics_port", "dist_port", "gateway.http_port"):
            port = self.gateway.http_port if key == "gateway.http_port" else getattr(self, key)
            if port == 0 and key == "port":
                raise ConfigError(f"{p}.port: required")
            if not 0 <= port < 65536:
                raise ConfigError(f"{p}.{key}: expected a port number, got {port}")
            if port:
                ports_needed = self.tp_size if key == "dist_port" else 1
                for q in range(port, port + ports_needed):
                    if q in ports:
                        raise ConfigError(f"{p}.{key}: port {q} is also used by {ports[q]}")
                    ports[q] = f"{p}.{key}"

    def _validate_process(self, p: str) -> None:
        """Ranks, messages, drain, MPS share, the fault hook, the rendezvous and the GPUs of the ranks."""
        positive(f"{p}.tp_size", self.tp_size)
        positive(f"{p}.max_message_bytes", self.max_message_bytes)
        positive(f"{p}.drain_grace_s", self.drain_grace_s, allow_zero=True)
        positive(f"{p}.memory_trim_interval_s", self.memory_trim_interval_s, allow_zero=True)
        if not 0 <= self.mps_active_thread_percentage <= 100:
            raise ConfigError(
                f"{p}.mps_active_thread_percentage: expected 0 (no limit) to 100, "
                f"got {self.mps_active_thread_percentage}"
            )
        if self.fault is not None:
            self.fault.validate(f"{p}.fault", self.kind, self.tp_size)
        if self.tp_size > 1 and self.dist_port == 0:
            raise ConfigError(f"{p}.dist_port: required when tp_size > 1")
        if self.device == "cuda" and self.gpus and len(self.gpus) != self.tp_size:
            raise ConfigError(
                f"{p}.gpus: expected {self.tp_size} GPU indices (one per rank), got {list(self.gpus)}"
            )

    def _validate_gpus(self, p: str) -> None:
        if any(g < 0 for g in self.gpus):
            raise ConfigError(f"{p}.gpus: expected GPU indices >= 0, got {list(self.gpus)}")
        m = self.memory
        if (
            self.device == "cpu"
            and m.simulated_capacity_bytes
            and self.gpus
            and len(self.gpus) != self.tp_size
        ):
            raise ConfigError(
                f"{p}.gpus: expected {self.tp_size} simulated GPU indices (one per rank), got {list(self.gpus)}"
            )

    def _validate_access(self, p: str) -> None:
        """Bind addresses, admin port, TLS, API keys: secrets are named (env var, file), never inline."""
        for key in ("bind_host", "admin_host"):
            if not getattr(self, key).strip():
                raise ConfigError(f"{p}.{key}: expected an address (127.0.0.1, 0.0.0.0, ...), got ''")
        if self.admin_api_key_env and not self.admin_port:
            raise ConfigError(f"{p}.admin_api_key_env: set admin_port too (the key protects the admin port)")
        public = {
            "tls": self.tls is not None,
            "api_keys_env": bool(self.api_keys_env),
            "api_keys_file": bool(self.api_keys_file),
            "gateway.media_dir": bool(self.gateway.media_dir),
            "gateway.http_port": bool(self.gateway.http_port),
        }
        for key, is_set in public.items():
            if is_set and self.kind != "gateway":
                raise ConfigError(
                    f"{p}.{key}: only the gateway serves clients from outside (kind is {self.kind})"
                )
        if self.tls is not None:
            self.tls.validate(f"{p}.tls")
            if not self.admin_port:
                raise ConfigError(
                    f"{p}.admin_port: required when tls is set (the launcher checks health there)"
                )
            if self.tls.client_ca_file and self.gateway.http_port:
                raise ConfigError(
                    f"{p}.gateway.http_port: not with tls.client_ca_file (the HTTP front calls the "
                    "Omni port and has no client certificate of its own)"
                )


# The model kinds (common/stages.py) whose limits are a section of ServiceConfig named after the kind,
# in table order (the thinker's are `engine` and `tp`).
STAGE_SECTIONS: tuple[str, ...] = tuple(
    kind for kind in MODEL_KINDS if kind in {f.name for f in dataclasses.fields(ServiceConfig)}
)
