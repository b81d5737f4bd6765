"""Per rank: the KV cache, and one forward per StepPlan with logits only for the rows that sample.

The only engine code that touches device tensors. Every rank runs the same plan; the model's own
collectives (row-parallel reductions, the vocab gather of compute_logits) keep them in lockstep, and
rank 0 gets the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omnistage.common.config import EngineConfig
from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.config import ResolvedEngineConfig, resolve_engine_config
from omnistage.services.thinker.engine.distributed import TPGroup
from omnistage.services.thinker.engine.step_plan import StepPlan
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.v1 import control_pb2
from torch import nn

log = get_logger(__name__)


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


class ModelRunner:
    """Owns this rank's model slice and KV cache (`[2, layers, *model.kv_cache_shape(...)]`)."""

    def __init__(
        self, model: nn.Module, cfg: ResolvedEngineConfig, device: str | torch.device, rank: int = 0
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank = rank
        layers = model.attention_layers()
        shape = model.kv_cache_shape(cfg.num_kv_blocks, cfg.block_size)
        dtype = next(model.parameters()).dtype
        self.kv_cache = torch.zeros(2, len(layers), *shape, dtype=dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.k_cache = self.kv_cache[0, i]
            layer.v_cache = self.kv_cache[1, i]
        log.info(
            "KV cache: %d blocks x %d tokens, %.1f MiB",
            cfg.num_kv_blocks,
            cfg.block_size,
            self.kv_cache.numel() * self.kv_cache.element_size() / 2**20,
        )

    @classmethod
    def from_checkpoint(
        cls,
        ckpt_dir: str | Path,
        engine_cfg: EngineConfig,
        dtype: torch.dtype | str,
        device: str | torch.device,
        group: TPGroup,
        progress: Callable[[int, int], None] | None = None,
    ) -> ModelRunner:
        """Load this rank's shard and size the cache; all ranks agree on the block count first.

        `progress(done_shards, total_shards)` reports weight loading (the service's phase progress).
        """
        from omnistage.services.thinker.models.loader import load_model

        model = group.guard(
            "loading weights",
            lambda: load_model(
                ckpt_dir,
                dtype=to_dtype(dtype),
                device=device,
                tp_rank=group.rank,
                tp_size=group.world_size,
                progress=progress,
            ),
        )
        blocks = group.agree_min(resolve_engine_config(engine_cfg).num_kv_blocks, "agreeing on KV blocks")
        return cls(model, resolve_engine_config(engine_cfg, blocks), device, group.rank)

    def memory_report(self) -> control_pb2.MemoryReport:
        """What this rank holds on its device (weights and KV cache), for Describe and metrics."""
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        weights += sum(b.numel() * b.element_size() for b in self.model.buffers())
        kv = self.kv_cache.numel() * self.kv_cache.element_size()
        return control_pb2.MemoryReport(
            device=str(self.device), weights_bytes=weights, kv_cache_bytes=kv, total_bytes=weights + kv
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step; returns float32 logits [R, vocab] on rank 0 (None elsewhere or if R == 0)."""
        if plan.num_tokens == 0:
            return None
        dev = self.device
        md = AttentionMetadata(
            query_lens=plan.query_lens.tolist(),
            context_lens=plan.context_lens.tolist(),
            slot_mapping=plan.slot_mapping.to(dev, non_blocking=True),
            block_tables=plan.block_tables.to(dev, non_blocking=True),
        )
        with attention_metadata(md):
            hidden = self.model(
                plan.input_ids.to(dev, non_blocking=True), plan.positions.to(dev, non_blocking=True)
            )
        if plan.sample_rows.numel() == 0:
            return None
        logits = self.model.compute_logits(hidden[plan.sample_rows.to(dev)])
        return logits.float() if self.rank == 0 else None
