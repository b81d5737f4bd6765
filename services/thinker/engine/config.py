"""The engine's resolved limits: the deploy file's EngineConfig plus the numbers derived at start-up.

The deploy config stays untouched (frozen); what the engine computes (KV block count, the longest
request the cache can hold) lives here, so every component reads one object.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from omnistage.common.config import EngineConfig


@dataclass(frozen=True)
class ResolvedEngineConfig:
    """EngineConfig with `num_kv_blocks` decided and `max_model_len` capped by the cache capacity."""

    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    chunked_prefill: bool
    default_max_tokens: int
    max_queued_requests: int
    prefix_caching: bool = True
    prefill_tokens_while_decoding: int = 0  # 0: no cap beyond max_num_batched_tokens
    async_scheduling: str = "auto"  # auto | on | off (async_scheduling_on decides for a device)
    gather_arrivals_ms: float = 5.0  # the request flow's: how long an idle engine's first step waits

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


# The fields decided at start-up; every other one is the deploy config's, as it is.
_DECIDED = ("num_kv_blocks", "max_model_len")


def async_scheduling_on(mode: str, device: torch.device) -> bool:
    """Whether the engine plans the next step while the device runs this one: `auto` where the
    device runs behind the host (CUDA); a CPU computes as the host calls, so there it buys nothing."""
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def auto_num_kv_blocks(cfg: EngineConfig) -> int:
    """CPU default: room for max_num_seqs requests of max_model_len tokens each."""
    return cfg.max_num_seqs * -(-cfg.max_model_len // cfg.block_size)


def resolve_engine_config(cfg: EngineConfig, num_kv_blocks: int | None = None) -> ResolvedEngineConfig:
    """Decide the KV block count (argument > config > auto) and cap max_model_len to what fits."""
    blocks = num_kv_blocks or cfg.num_kv_blocks or auto_num_kv_blocks(cfg)
    if blocks < 1:
        raise ValueError(f"engine: num_kv_blocks must be >= 1, got {blocks}")
    max_model_len = min(cfg.max_model_len, blocks * cfg.block_size)
    if not cfg.chunked_prefill and cfg.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"engine: max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_model_len "
            f"({max_model_len}) when chunked_prefill is false"
        )
    kept = {f.name: getattr(cfg, f.name) for f in fields(ResolvedEngineConfig) if f.name not in _DECIDED}
    return ResolvedEngineConfig(**kept, num_kv_blocks=blocks, max_model_len=max_model_len)
