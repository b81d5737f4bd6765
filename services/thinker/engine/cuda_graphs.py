"""Decode steps replayed from CUDA graphs: one graph per padded batch size, captured at start-up."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable

import torch
from omnistage.common.log import get_logger
from omnistage.common.memory.device import fmt_bytes
from omnistage.services.thinker.engine.decode_staging import DecodeStaging
from omnistage.services.thinker.engine.sampled_feed import SampledFeed
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.services.thinker.models.layers.backends import stage_overlap_enabled
from omnistage.services.thinker.tp.plan import PlanKind, StepPlan
from torch import nn

log = get_logger(__name__)

# Batch sizes up to this get a graph per staging buffer (engine/decode_staging.py): their steps' input
# copy runs while the step before computes instead of after it (~5 µs of a one-sequence step's ~1.1 ms
# on an H200); a larger step's copy is a smaller share of it, not worth a graph more each.
OVERLAP_MAX_BATCH = 2


def graph_batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 up to max_batch, and max_batch itself."""
    sizes = [s for s in (1, 2, 4) if s < max_batch] + list(range(8, max_batch + 1, 8))
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sorted(set(sizes))


def graph_reserve_bytes(max_batch: int, vocab_local: int, tp_size: int) -> int:
    """What the captured graphs keep on the device, for the KV profile to leave free: each size's
    logits output plus the largest size's logits in flight (local + gathered), and a margin for the
    activations of one decode step (small next to the logits). Counted at 4 bytes a value: the
    outputs are in the model's dtype (2 bytes in bf16, no fp32 copy), so this is an upper bound."""
    sizes = graph_batch_sizes(max_batch)
    sizes += [s for s in sizes if s <= OVERLAP_MAX_BATCH]  # a graph per staging buffer (an upper bound)
    outputs = sum(sizes) * vocab_local * tp_size * 4
    in_flight = max_batch * vocab_local * (2 + 2 * tp_size)
    return outputs + in_flight + (64 << 20)


def stage_token_rows(
    plan: StepPlan, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, n: int, size: int
) -> None:
    """A plan's n token rows into a graph's host arrays, rows n..size padding: token 0, position 0,
    no cache slot (-1: nothing written)."""
    ids[:n] = plan.input_ids
    ids[n:size] = 0
    pos[:, :n] = plan.positions
    pos[:, n:size] = 0
    slots[:n] = plan.slot_mapping
    slots[n:size] = -1


def capture_graph(
    forward: Callable[[], torch.Tensor], pool, stream: torch.cuda.Stream, device: torch.device
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One graph of `forward` in `pool` (shared by a graph set, captured largest first), and its
    output: run once eagerly on the side stream first (its kernels compile outside the capture)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    # thread_local: the peer watch and NCCL's watchdog may touch CUDA while this thread captures
    capturing = torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")
    with torch.inference_mode(), capturing:
        output = forward()
    return graph, output


class DecodeGraphs:
    """Static decode buffers, one graph per batch size (two at OVERLAP_MAX_BATCH or fewer sequences: one
    per staging buffer); a KV-cache user (graphs die with the cache)."""

    def __init__(
        self,
        model: nn.Module,
        max_batch: int,
        max_blocks: int,
        device: torch.device,
        capture: bool = True,
        feed: SampledFeed | None = None,
    ) -> None:
        if max_batch < 1 or max_blocks < 1:
            raise ValueError(
                f"decode graphs need max_batch and max_blocks >= 1 (got {max_batch}, {max_blocks})"
            )
        self.model = model
        # With a feed, the forward (and so each graph) puts the last step's sampled ids in place of
        # the plan's placeholders itself, from the feed's buffer: no gather queued between replays.
        self.feed = feed
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch, self.width, self.device, self.capture_enabled = max_batch, max_blocks, device, capture
        n = max_batch
        layout = (n, 3 * n, n, n, n * max_blocks)  # ids, positions, slots, context lens, tables
        overlap = self.sizes[0] <= OVERLAP_MAX_BATCH and stage_overlap_enabled()
        self.staging = DecodeStaging(layout, device, buffers=2 if overlap else 1)
        self.hosts = self.staging.hosts
        self._use(0)
        # (batch size, staging buffer) -> its graph and its output
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.ready = not capture  # eager mode needs no capture; captured mode only after capture()
        self.replays = 0
        self.pool_bytes = 0  # what the capture took on the device (the memory report's graph pool)

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.staging.views(buf, self.max_batch, self.width)

    def _use(self, buffer: int) -> None:
        """The step being staged reads staging buffer `buffer` (`ids`, `pos`, ... its views)."""
        self.buffer = buffer
        self.staged = self.staging.buffers[buffer]
        self.ids, self.pos, self.slots, self.ctx, self.tables = self._views(self.staged)

    def buffers_of(self, size: int) -> tuple[int, ...]:
        """The staging buffers a step of `size` may read: both at OVERLAP_MAX_BATCH or fewer (a graph
        each), else the first."""
        return tuple(range(len(self.staging.buffers))) if size <= OVERLAP_MAX_BATCH else (0,)

    def _buffer_for(self, size: int) -> int:
        """A small step takes the buffer the step before did not (its copy need not wait for that
        step); a larger one the first."""
        return self.buffer ^ 1 if len(self.buffers_of(size)) == 2 else 0

    # --- which steps -----------------------------------------------------------------------------

    def size_for(self, num_seqs: int) -> int:
        """The smallest captured size that holds `num_seqs` sequences."""
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def covers(self, plan: StepPlan) -> bool:
        """A pure decode step within the captured sizes and block-table width."""
        seqs = int(plan.query_lens.numel())
        return (
            self.ready
            and plan.kind is PlanKind.RUN
            and 0 < seqs <= self.max_batch
            and plan.num_tokens == seqs
            and plan.num_media_rows == 0
            and plan.hidden_index.numel() == 0
            and plan.sample_rows.numel() == seqs
            and plan.block_tables.shape[1] <= self.width
        )

    # --- one step ---------------------------------------------------------------------------------

    def run(self, plan: StepPlan, fill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [n, vocab] of a covered decode step in the model's dtype, as compute_logits gives
        them (no fp32 copy in the graph: the sampler casts what it reads values of, its greedy argmax
        reads these). A view of the graph's output: queue what reads it before the next step. `fill`
        puts the previous step's sampled ids in place of the plan's placeholders, on the device
        (SampledFeed.fill)."""
        n = int(plan.query_lens.numel())
        size = self.size_for(n)
        self._stage(plan, n, size)
        if fill is not None and self.feed is not None:
            self.feed.require_shared()  # the forward reads the ids from the feed's buffer
        elif fill is not None:
            self.ids[:n].copy_(fill(self.ids[:n]))
        key = (size, self.buffer)
        graph = self.graphs.get(key)
        if graph is None:
            logits = self._forward(size)[:n]
        else:
            graph.replay()
            self.replays += 1
            logits = self.outputs[key][:n]
        self.staging.release(self.buffer)
        return logits

    def _stage(self, plan: StepPlan, n: int, size: int) -> None:
        """The plan into a host array (padding rows: token 0, slot -1, length 0), then one copy into
        the step's staging buffer."""
        self._use(self._buffer_for(size))
        host = self.staging.next_host()
        ids, pos, slots, ctx, tables = self._views(host)
        width = plan.block_tables.shape[1]
        stage_token_rows(plan, ids, pos, slots, n, size)
        ctx[:n] = plan.context_lens
        ctx[n:size] = 0
        tables[:n, :width] = plan.block_tables
        self.staging.copy_in(host, self.buffer)

    def _forward(self, size: int) -> torch.Tensor:
        """The model over the first `size` static rows; every length comes from the buffers."""
        md = AttentionMetadata(
            query_lens=[1] * size,
            context_lens=[1] * size,  # placeholders: graph-safe backends read context_lens_tensor
            slot_mapping=self.slots[:size],
            block_tables=self.tables[:size],
            context_lens_tensor=self.ctx[:size],
        )
        # With a feed the staged placeholders go to the model as they are, with the buffer they name:
        # its embedding lookup resolves them (one launch on the fast backends: kernels/embed_gather.py).
        sampled = {} if self.feed is None else {"sampled": self.feed.buffer}
        with attention_metadata(md):
            hidden = self.model(self.ids[:size], self.pos[:, :size], **sampled)
        return self.model.compute_logits(hidden)

    # --- capture ----------------------------------------------------------------------------------

    def capture(
        self,
        progress: Callable[[str, int, int], None] | None = None,
        align: Callable[[int], None] | None = None,
    ) -> int:
        """Capture every size, largest first, into one memory pool; returns the bytes it took.

        `align(size)` (TP groups) runs before each size once this rank's device is idle: the ranks
        agree on the size they capture next, so none enters a capture (where collectives are only
        recorded) while a peer still runs the eager forward whose collectives need it."""
        if not self.capture_enabled:
            return 0
        torch.cuda.empty_cache()  # the capture empties the cache too: measure from an empty one
        before = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        started = time.monotonic()
        keys = [(size, buffer) for size in reversed(self.sizes) for buffer in self.buffers_of(size)]
        for i, (size, buffer) in enumerate(keys):
            if align is not None:
                torch.cuda.synchronize(self.device)
                align(size)
            self._stage_padding(size, buffer)  # the forward below reads this buffer
            self.graphs[(size, buffer)], self.outputs[(size, buffer)] = capture_graph(
                lambda size=size: self._forward(size), pool, stream, self.device
            )
            if progress is not None:
                what = f"decode graph batch {size}" + (f" (staging buffer {buffer})" if buffer else "")
                progress(what, i + 1, len(keys))
        torch.cuda.synchronize(self.device)
        self.ready = True
        took = torch.cuda.memory_reserved(self.device) - before
        self.pool_bytes = max(took, 0)
        log.info(
            "captured %d decode graphs (batch %s) in %.1fs, %s",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            time.monotonic() - started,
            fmt_bytes(took),
        )
        return took

    def _stage_padding(self, size: int, buffer: int) -> None:
        """Every row of staging buffer `buffer` padding (nothing is written to the cache while
        capturing), and the forward reading it."""
        self._use(buffer)
        host = self.staging.next_host()
        host[:] = 0
        self._views(host)[2][:size] = -1
        self.staging.copy_in(host, buffer, blocking=True)

    # --- the KV cache: graphs point into it, so they go when it goes -------------------------------

    def bind_kv(self, kv_cache: torch.Tensor) -> None:
        """A new cache: graphs must be captured again (`capture`) before they are used."""

    def release_kv(self) -> None:
        self.release()

    def release(self) -> None:
        """Destroy the graphs now. A graph that captured NCCL collectives holds a reference on the
        communicator until it is destroyed, and destroying the communicator waits for it: a TP
        group releases its graphs before it leaves (TPControl.on_close), else the exit hangs."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()
        self.ready = not self.capture_enabled
