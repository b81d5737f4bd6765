"""Small prefill and mixed steps replayed from CUDA graphs: one graph per padded token count.

A short prompt's eager step is host-bound: ~25 launches a layer, each tens of µs of Python, while
its kernels (mostly the experts' weight reads) take less (one H200, Ming-flash's TP=2 rank shape,
64 new tokens: 26.6 ms to the first token for 14.5 ms of kernels; bench/RESULTS.md). A graph
replays the whole step in one launch. What the eager step plans per step on the host (the paged
prefill kernel's tile table) is staged into static buffers: the table padded to the most tiles a
step of the bucket can have (padding tiles have no tokens: their programs return at once), the
padding tokens write no cache slot (-1) and attend to nothing (their attention rows are zeroed),
and the logits are taken at a static row index padded with row 0. A step with encoder rows (an
image's, a spoken turn's audio) replays its size's media graph: the rows and their token slots
staged too (padding entries write a padding token's row, which a media step always has), each
token's router code on the device and every router run on every token (`RouterRows.every_router`:
the eager step's split by code syncs the host). Steps with hidden-state requests run eagerly, and
so do pure decode steps, which `DecodeGraphs` covers.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
from omnistage.common.log import get_logger
from omnistage.common.memory.device import fmt_bytes
from omnistage.services.thinker.engine.cuda_graphs import capture_graph, stage_token_rows
from omnistage.services.thinker.kernels.tile_table import TILE_FIELDS, prefill_tile_rows
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.services.thinker.models.layers.moe import RouterRows
from omnistage.services.thinker.tp.plan import PlanKind, StepPlan
from torch import nn

log = get_logger(__name__)


def max_tiles(tokens: int, seqs: int, block_q: int) -> int:
    """The most tiles a step of `tokens` new tokens over `seqs` sequences can cut into: each
    sequence's last tile may be partial."""
    return -(-tokens // block_q) + seqs


def prefill_graph_reserve_bytes(
    sizes: tuple[int, ...], max_seqs: int, vocab_local: int, tp_size: int, hidden: int, top_k: int
) -> int:
    """What the captured prefill graphs keep on the device, for the KV profile to leave free: each
    graph's logits output (a text and a media graph per size; counted at 4 bytes a value, an upper
    bound of the model's dtype), the static media rows, and the largest size's activations (the
    experts' fp32 outputs of every routed pair and the shared expert, the gate-up rows, a few
    hidden-sized rows), with a margin."""
    if not sizes:
        return 0
    outputs = 2 * len(sizes) * max_seqs * vocab_local * tp_size * 4 + max(sizes) * hidden * 4
    largest = max(sizes)
    activations = largest * hidden * ((top_k + 1) * 4 + (top_k + 1) * 2 + 16 * 2)
    return outputs + activations + (64 << 20)


class PrefillGraphs:
    """Static buffers of the largest size, one graph per token count; a KV-cache user."""

    def __init__(
        self,
        model: nn.Module,
        sizes: tuple[int, ...],
        max_seqs: int,
        max_blocks: int,
        block_q: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        if not sizes or min(sizes) < 1 or max_seqs < 1 or max_blocks < 1 or block_q < 1:
            raise ValueError(
                f"prefill graphs need token counts, max_seqs, max_blocks and block_q >= 1 "
                f"(got {sizes}, {max_seqs}, {max_blocks}, {block_q})"
            )
        self.model = model
        self.sizes = sorted(set(sizes))
        self.max_seqs, self.width, self.block_q = max_seqs, max_blocks, block_q
        self.device, self.capture_enabled = device, capture
        t, s = self.sizes[-1], max_seqs
        self.tiles_max = max_tiles(t, s, block_q)
        # ids, positions, slots, sample rows, tables; then the tile table (int32 for the kernel)
        self.layout = (t, 3 * t, t, s, s * max_blocks)
        total = sum(self.layout)
        pinned = device.type == "cuda"
        # Two pinned host arrays of each, used in turn (see DecodeGraphs: async scheduling stages a
        # step while the copy of the one before may still wait in the device's queue).
        self.hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
        self.host_tiles = [
            torch.zeros(self.tiles_max * TILE_FIELDS, dtype=torch.int32, pin_memory=pinned) for _ in range(2)
        ]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0
        self.staged = torch.zeros(total, dtype=torch.int64, device=device)
        self.tiles = torch.zeros(self.tiles_max, TILE_FIELDS, dtype=torch.int32, device=device)
        self.ids, self.pos, self.slots, self.sample, self.tables = self._views(self.staged)
        # A media step's encoder rows, their token slots and every token's router code (rank 0 fills
        # the rows; the embedding's all-reduce carries them to the other ranks, whose rows stay zero).
        param = next(model.parameters(), None)
        dtype = param.dtype if param is not None else torch.float32
        hidden = model.config.hidden_size if hasattr(model, "config") else 1
        self.media_index = torch.zeros(t, dtype=torch.int64, device=device)
        self.media_rows = torch.zeros(t, hidden, dtype=dtype, device=device)
        self.modality = torch.zeros(t, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self.ready = not capture
        self.replays = 0
        self.pool_bytes = 0

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self.sizes[-1]
        ids, pos, slots, sample, tables = torch.split(buf, self.layout)
        return ids, pos.view(3, t), slots, sample, tables.view(self.max_seqs, self.width)

    # --- which steps -----------------------------------------------------------------------------

    def size_for(self, plan: StepPlan) -> int:
        """The smallest captured token count that holds the plan's tokens (and, for a media step,
        one padding token, where the padding entries of the media slots point)."""
        return self.sizes[bisect.bisect_left(self.sizes, self._rows_needed(plan))]

    @staticmethod
    def _rows_needed(plan: StepPlan) -> int:
        return plan.num_tokens + (1 if plan.num_media_rows else 0)

    def covers(self, plan: StepPlan) -> bool:
        """A step with a prompt chunk (a prefill, or decodes beside one) within the sizes, with or
        without encoder rows; the same answer on every rank (it reads only what every plan carries)."""
        seqs = int(plan.query_lens.numel())
        return (
            self.ready
            and plan.kind is PlanKind.RUN
            and 0 < self._rows_needed(plan) <= self.sizes[-1]
            and plan.num_tokens > seqs  # some sequence adds more than one token: not a pure decode
            and seqs <= self.max_seqs
            and plan.hidden_index.numel() == 0
            and plan.sample_rows.numel() <= self.max_seqs
            and plan.block_tables.shape[1] <= self.width
        )

    # --- one step ---------------------------------------------------------------------------------

    def run(self, plan: StepPlan, fill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [R, vocab] of the plan's sampling rows in the model's dtype (a view of the
        graph's output: queue what reads it before the next step; the sampler casts to fp32 what
        it reads values of). `fill`: the previous step's sampled ids for the plan's placeholders,
        on the device (SampledFeed.fill)."""
        n = plan.num_tokens
        size = self.size_for(plan)
        media = plan.num_media_rows > 0
        self._stage(plan, n, size)
        if media:
            self._stage_media(plan, n, size)
        if fill is not None:
            self.ids[:n].copy_(fill(self.ids[:n]))
        rows = int(plan.sample_rows.numel())
        graph = self.graphs.get((size, media))
        if graph is None:
            return self._forward(size, media)[:rows]
        graph.replay()
        self.replays += 1
        return self.outputs[size, media][:rows]

    def _stage(self, plan: StepPlan, n: int, size: int) -> None:
        """The plan into the host arrays (padding tokens: id 0, slot -1; padding tiles: no tokens;
        padding sample rows: row 0), then one copy each."""
        host, host_tiles = self._next_host()
        ids, pos, slots, sample, tables = self._views(host)
        seqs, width, rows = (
            int(plan.query_lens.numel()),
            plan.block_tables.shape[1],
            int(plan.sample_rows.numel()),
        )
        stage_token_rows(plan, ids, pos, slots, n, size)
        sample[:rows] = plan.sample_rows
        sample[rows:] = 0
        tables[:seqs, :width] = plan.block_tables
        tiles = prefill_tile_rows(plan.query_lens.tolist(), plan.context_lens.tolist(), self.block_q)
        host_tiles.zero_()
        host_tiles[: len(tiles)] = torch.tensor(tiles, dtype=torch.int32)
        self.staged.copy_(host, non_blocking=True)
        self.tiles.view(-1).copy_(host_tiles, non_blocking=True)
        if self.device.type == "cuda":
            self.copied[self.turn] = torch.cuda.Event()
            self.copied[self.turn].record()

    def _stage_media(self, plan: StepPlan, n: int, size: int) -> None:
        """The step's encoder rows (rank 0: the plan carries them) at their slots, the rest of the
        slots on the last padding token; every token's router code (text where no row goes)."""
        m = plan.num_media_rows
        index = torch.full((size,), size - 1, dtype=torch.int64)
        index[:m] = plan.media_index
        codes = torch.zeros(size, dtype=torch.int64)
        codes[plan.media_index] = plan.media_modality.to(torch.int64)
        self.media_index[:size].copy_(index, non_blocking=True)
        self.modality[:size].copy_(codes, non_blocking=True)
        if plan.media_rows is not None:
            self.media_rows[:m].copy_(plan.media_rows, non_blocking=True)
        self.media_rows[m:size].zero_()

    def _next_host(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The host arrays whose last copies have left them."""
        self.turn ^= 1
        copied = self.copied[self.turn]
        if copied is not None:
            copied.synchronize()
        return self.hosts[self.turn], self.host_tiles[self.turn]

    def _forward(self, size: int, media: bool = False) -> torch.Tensor:
        """The model over the first `size` static token rows (a media step: with the staged encoder
        rows and router codes); the attention reads the staged tile table (`graph_tiles`), so the
        metadata's lengths are placeholders of one sequence."""
        md = AttentionMetadata(
            query_lens=[size],
            context_lens=[size],
            slot_mapping=self.slots[:size],
            block_tables=self.tables,
            step_state={"graph_tiles": self.tiles},
        )
        extra = {}
        if media:
            extra = dict(
                modality=RouterRows.every_router(self.modality[:size]),
                media_index=self.media_index[:size],
                media_rows=self.media_rows[:size],
            )
        with attention_metadata(md):
            hidden = self.model(self.ids[:size], self.pos[:, :size], **extra)
        return self.model.compute_logits(hidden[self.sample])

    # --- capture ----------------------------------------------------------------------------------

    def capture(
        self,
        progress: Callable[[str, int, int], None] | None = None,
        align: Callable[[int], None] | None = None,
    ) -> int:
        """Capture every size, largest first, into one memory pool; returns the bytes it took.
        `align(size)`: as DecodeGraphs.capture (TP ranks agree on each size before capturing it)."""
        if not self.capture_enabled:
            return 0
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        started = time.monotonic()
        keys = [(size, media) for size in reversed(self.sizes) for media in (False, True)]
        for i, (size, media) in enumerate(keys):
            if align is not None:
                torch.cuda.synchronize(self.device)
                align(2 * size + media)  # every rank at the same size and kind
            self._stage_padding()
            self.graphs[size, media], self.outputs[size, media] = capture_graph(
                lambda size=size, media=media: self._forward(size, media), pool, stream, self.device
            )
            if progress is not None:
                kind = "media" if media else "text"
                progress(f"prefill graph {size} tokens ({kind})", i + 1, len(keys))
        torch.cuda.synchronize(self.device)
        self.ready = True
        took = torch.cuda.memory_reserved(self.device) - before
        self.pool_bytes = max(took, 0)
        log.info(
            "captured %d prefill graphs (text and media at tokens %s) in %.1fs, %s",
            len(keys),
            ",".join(map(str, self.sizes)),
            time.monotonic() - started,
            fmt_bytes(took),
        )
        return took

    def _stage_padding(self) -> None:
        """Every row padding: no cache writes, no tiles, no encoder rows (their slots on the last
        token), while capturing."""
        host, host_tiles = self._next_host()
        host[:] = 0
        self._views(host)[2][:] = -1
        host_tiles.zero_()
        self.staged.copy_(host)
        self.tiles.view(-1).copy_(host_tiles)
        self.media_index.fill_(0)
        self.media_rows.zero_()
        self.modality.zero_()

    # --- the KV cache: graphs point into it, so they go when it goes -------------------------------

    def bind_kv(self, kv_cache: torch.Tensor) -> None:
        """A new cache: graphs must be captured again (`capture`) before they are used."""

    def release_kv(self) -> None:
        self.release()

    def release(self) -> None:
        """Destroy the graphs now (see DecodeGraphs.release: captured collectives hold the
        communicator until then)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.ready = not self.capture_enabled
