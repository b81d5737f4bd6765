"""Per rank: the KV cache, and one forward per StepPlan with logits only for the rows that sample.

The only engine code that touches device tensors (start-up — load, size the cache, warm up — is
`startup.py`). Every rank runs the same plan; the model's own collectives (row-parallel
reductions, the vocab gather of compute_logits) keep them in lockstep, and rank 0 gets the logits
(and the final-norm hidden rows hidden-state requests keep: `StepOutput.hidden`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from omnistage.common.log import get_logger
from omnistage.common.memory.device import fmt_bytes
from omnistage.services.thinker.engine.config import ResolvedEngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.prefill_graphs import PrefillGraphs
from omnistage.services.thinker.engine.sampled_feed import SampledFeed
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.tp.plan import StepPlan
from omnistage.v1 import control_pb2
from torch import nn

log = get_logger(__name__)


def to_dtype(dtype: torch.dtype | str) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)


@dataclass
class StepOutput:
    """What one step gives rank 0: the logits [R, vocab] of the sampling rows in the model's dtype
    (None when R == 0; the sampler casts to fp32 what it reads values of) and the final-norm hidden
    states [K, H] at `plan.hidden_index` (None when K == 0)."""

    logits: torch.Tensor | None = None
    hidden: torch.Tensor | None = None


class KVCacheUser(Protocol):
    """Anything that keeps a tensor derived from the KV cache (CUDA graphs later, attention wrappers):
    registered with the runner, it is released before the cache is torn down and bound again after
    every rebuild, so no stale view pins the old cache (memory_transport.md §3.6)."""

    def bind_kv(self, kv_cache: torch.Tensor) -> None: ...
    def release_kv(self) -> None: ...


class ModelRunner:
    """Owns this rank's model slice and KV cache (`[2, layers, *model.kv_cache_shape(...)]`)."""

    def __init__(
        self,
        model: nn.Module,
        cfg: ResolvedEngineConfig,
        device: str | torch.device,
        rank: int = 0,
        allocate: bool = True,
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank = rank
        # max_model_len as configured (cfg.max_model_len is capped by whatever cache is built).
        self.requested_max_model_len = cfg.max_model_len
        # No plan's position leaves what a sequence of max_model_len tokens can have (admission keeps
        # prompt + max_tokens within it; the cache's cap only lowers it): the rope's table holds them.
        bound = getattr(model, "bound_positions", None)  # the thinker's (test doubles have none)
        if bound is not None:
            bound(cfg.max_model_len)
        self.kv_cache: torch.Tensor | None = None
        self.kv_users: list[KVCacheUser] = []
        # Set by the KV auto-profile (0 when the cache was not profiled): for Describe and metrics.
        self.budget_bytes = 0
        self.activation_peak_bytes = 0
        # Decode steps replayed from CUDA graphs (engine/cuda_graphs.py), set by start-up when captured.
        self.graphs: DecodeGraphs | None = None
        # Small text prefill and mixed steps replayed from CUDA graphs (engine/prefill_graphs.py).
        self.prefill_graphs: PrefillGraphs | None = None
        # The last shared step's sampled ids, for the placeholders of the next plan (async scheduling).
        self.feed = SampledFeed(self.device, TPGroup.from_default_group(), cfg.max_num_seqs)
        if allocate:
            self.allocate_kv(cfg.num_kv_blocks)

    # --- the KV cache: built and torn down in one place -------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return 0 if self.kv_cache is None else int(self.kv_cache.shape[2])

    def kv_block_bytes(self) -> int:
        """Bytes of one KV block on this rank (K and V of every layer)."""
        shape = self.model.kv_cache_shape(1, self.cfg.block_size)
        per_layer = 2 * math.prod(shape) * self.dtype.itemsize
        return per_layer * len(self.model.attention_layers())

    def kv_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def allocate_kv(self, num_blocks: int) -> None:
        """Build the cache of `num_blocks` blocks and point every layer and KV user into it."""
        if self.kv_cache is not None:
            raise RuntimeError("allocate_kv: a KV cache exists; free_kv() first")
        if num_blocks < 1:
            raise ValueError(f"allocate_kv: num_blocks must be >= 1, got {num_blocks}")
        layers = self.model.attention_layers()
        shape = self.model.kv_cache_shape(num_blocks, self.cfg.block_size)
        kv = torch.zeros(2, len(layers), *shape, dtype=self.dtype, device=self.device)
        self.kv_cache = kv
        for i, layer in enumerate(layers):
            layer.k_cache = kv[0, i]
            layer.v_cache = kv[1, i]
        for user in self.kv_users:
            user.bind_kv(kv)
        self.cfg = dataclasses.replace(
            self.cfg,
            num_kv_blocks=num_blocks,
            max_model_len=min(self.requested_max_model_len, num_blocks * self.cfg.block_size),
        )
        log.info(
            "KV cache: %d blocks x %d tokens, %s", num_blocks, self.cfg.block_size, fmt_bytes(self.kv_bytes())
        )

    def free_kv(self) -> None:
        """Drop the cache and every reference into it (KV users first, then the layer views)."""
        for user in self.kv_users:
            user.release_kv()
        for layer in self.model.attention_layers():
            layer.k_cache = torch.empty(0)
            layer.v_cache = torch.empty(0)
        self.kv_cache = None

    def weights_bytes(self) -> int:
        weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return weights + sum(b.numel() * b.element_size() for b in self.model.buffers())

    def memory_report(self) -> control_pb2.MemoryReport:
        """What this rank holds on its device, for Describe and metrics: weights, KV cache, the
        activation peak measured by the auto-profile, the decode graphs' pool, and the budget it was
        sized against."""
        weights = self.weights_bytes()
        kv = self.kv_bytes()
        activation = self.activation_peak_bytes
        graphs = self.graphs.pool_bytes if self.graphs is not None else 0
        graphs += self.prefill_graphs.pool_bytes if self.prefill_graphs is not None else 0
        return control_pb2.MemoryReport(
            device=str(self.device),
            budget_bytes=self.budget_bytes,
            weights_bytes=weights,
            kv_cache_bytes=kv,
            activation_peak_bytes=activation,
            graph_pool_bytes=graphs,
            total_bytes=weights + kv + activation + graphs,
        )

    def use_graphs(self, graphs: DecodeGraphs) -> None:
        """Replay covered decode steps from `graphs` (already captured against this cache, or eager)."""
        self.graphs = graphs
        self.kv_users.append(graphs)

    def use_prefill_graphs(self, graphs: PrefillGraphs) -> None:
        """Replay covered prefill and mixed steps from `graphs` (captured against this cache, or eager)."""
        self.prefill_graphs = graphs
        self.kv_users.append(graphs)

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        """Run one step; returns the logits [R, vocab] in the model's dtype on rank 0 (None elsewhere
        or if R == 0)."""
        return self.execute_step(plan).logits

    @torch.inference_mode()
    def execute_step(self, plan: StepPlan) -> StepOutput:
        """Run one step: the logits of the sampling rows and (rank 0) the hidden rows the plan keeps."""
        if plan.num_tokens == 0:
            return StepOutput()
        fill = self.feed.fill if plan.has_placeholders else None
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.covers(plan):
                logits = graphs.run(plan, fill)
                return StepOutput(logits if self.rank == 0 and logits.shape[0] else None)
        dev = self.device
        md = AttentionMetadata(
            query_lens=plan.query_lens.tolist(),
            context_lens=plan.context_lens.tolist(),
            slot_mapping=plan.slot_mapping.to(dev, non_blocking=True),
            block_tables=plan.block_tables.to(dev, non_blocking=True),
            context_lens_tensor=plan.context_lens.to(dev, torch.int32, non_blocking=True),
            host_block_tables=plan.block_tables,
        )
        ids = plan.input_ids.to(dev, non_blocking=True)
        with attention_metadata(md):
            hidden = self.model(
                fill(ids) if fill is not None else ids,
                plan.positions.to(dev, non_blocking=True),
                **self._media_inputs(plan),
            )
        kept = hidden[plan.hidden_index.to(dev)] if plan.hidden_index.numel() and self.rank == 0 else None
        if plan.sample_rows.numel() == 0:
            return StepOutput(hidden=kept)
        logits = self.model.compute_logits(hidden[plan.sample_rows.to(dev)])
        return StepOutput(logits if self.rank == 0 else None, kept)

    def sample_target(self, plan: StepPlan) -> torch.Tensor:
        """Where rank 0 samples the ids of a step whose plan shares them (the feed's buffer)."""
        return self.feed.target(plan)

    def share_sampled(self, plan: StepPlan, tokens: torch.Tensor | None = None) -> None:
        """After a step whose plan shares its sampled ids: keep them on this rank's device (rank 0
        passes its `tokens`; the others receive them: a collective under TP)."""
        self.feed.share(plan, tokens)

    def _media_inputs(self, plan: StepPlan) -> dict[str, torch.Tensor | None]:
        """The step's embedding overrides and per-token router codes; none in text-only steps.

        Every rank gets the token rows to override and the codes from the plan; only rank 0 has the
        encoder rows (the model's embedding all-reduce carries them to the others, see step_plan)."""
        if plan.num_media_rows == 0:
            return {}
        dev = self.device
        index = plan.media_index.to(dev, non_blocking=True)
        modality = torch.zeros(plan.num_tokens, dtype=torch.int8, device=dev)
        modality[index] = plan.media_modality.to(dev, torch.int8, non_blocking=True)
        rows = None
        if plan.media_rows is not None:
            rows = plan.media_rows.to(dev, self.dtype, non_blocking=True)
        elif self.rank == 0:
            raise RuntimeError(
                f"step plan splices {plan.num_media_rows} media rows but carries none on rank 0"
            )
        return {"modality": modality, "media_index": index, "media_rows": rows}
