"""The typed deploy file: frozen dataclasses loaded strictly from one YAML plus `--set` overrides.

One module per section, each dataclass validating itself; unknown keys and bad values fail with the
key path (`services.thinker.engine.block_size: expected > 0, got 0`). Every knob is in docs/config.md.
"""

from omnistage.common.config.checks import ConfigError
from omnistage.common.config.deploy import (
    CAPABILITY_HEALTH_PREFIX,
    WILDCARD_HOSTS,
    DeployConfig,
    ModelConfig,
    join_host_port,
)
from omnistage.common.config.devices import DevicesConfig, MpsConfig
from omnistage.common.config.encoder import EncoderConfig
from omnistage.common.config.engine import ATTENTION_BACKENDS, MOE_BACKENDS, EngineConfig
from omnistage.common.config.gateway import GatewayConfig
from omnistage.common.config.imagegen import IMAGE_SIZE_MULTIPLE, ImageGenConfig
from omnistage.common.config.loading import (
    apply_overrides,
    config_from_dict,
    config_hash,
    config_to_dict,
    load_config,
    parse_override,
)
from omnistage.common.config.memory import MemoryConfig
from omnistage.common.config.service import STAGE_SECTIONS, ServiceConfig, ServiceKind
from omnistage.common.config.startup import STARTUP_PHASES, FaultConfig, Phase, StartupConfig
from omnistage.common.config.supervision import SupervisionConfig
from omnistage.common.config.talker import TalkerConfig
from omnistage.common.config.tls import TlsConfig
from omnistage.common.config.tp import TPConfig

__all__ = [
    "ATTENTION_BACKENDS",
    "CAPABILITY_HEALTH_PREFIX",
    "IMAGE_SIZE_MULTIPLE",
    "MOE_BACKENDS",
    "STAGE_SECTIONS",
    "STARTUP_PHASES",
    "WILDCARD_HOSTS",
    "ConfigError",
    "DeployConfig",
    "DevicesConfig",
    "EncoderConfig",
    "EngineConfig",
    "FaultConfig",
    "GatewayConfig",
    "ImageGenConfig",
    "MemoryConfig",
    "ModelConfig",
    "MpsConfig",
    "Phase",
    "ServiceConfig",
    "ServiceKind",
    "StartupConfig",
    "SupervisionConfig",
    "TPConfig",
    "TalkerConfig",
    "TlsConfig",
    "apply_overrides",
    "config_from_dict",
    "config_hash",
    "config_to_dict",
    "join_host_port",
    "load_config",
    "parse_override",
]
