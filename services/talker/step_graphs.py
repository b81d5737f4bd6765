"""Static-shape talker steps: the LM decode and the whole CFM sample (Euler steps × CFG, aggregator, stop
head) run on fixed buffers at padded batch sizes, captured as CUDA graphs on CUDA (issue 21).

A step of eager PyTorch is launch-bound (hundreds of small kernels: 10 Euler steps × a DiT forward,
24 LM layers); a graph replays them in one launch. Graphs need fixed shapes and addresses, so:
- batches are padded up to a bucket (1, 2, 4, … up to the stream cap); padded LM rows write the KV
  cache's scratch slot at position 0 and their outputs are never read;
- the LM reads its keys up to a span bucket (powers of two up to the cache length) instead of the
  longest row's end; keys past a row's end are masked, so the result is the eager one;
- every input goes into a buffer allocated outside the graph's pool (host values through one pinned
  staging copy), every output is copied out into one, and callers get clones of the real rows;
- the CFM's noise is drawn outside (each stream's own generator, exactly as the eager path) and
  copied in; the time embeddings, step sizes and rotary tables are made once (`FlowDiT.plan`).
Nothing in a step reads the device from the host: the engine's one sync is its read of the stop
probabilities.

With `capture=False` (the CPU, and tests) the same bodies run eagerly on the same buffers, so the
bucketing, padding and buffer logic is tested without a GPU; it equals the eager path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from omnistage.services.talker.models.dit import SamplePlan
from omnistage.services.talker.models.qwen2 import KVSlots, Rows
from omnistage.services.talker.models.talker_lm import TalkerModel

MIN_SPAN = 64


def batch_buckets(cap: int) -> list[int]:
    """1, 2, 4, … below `cap`, then `cap`: the padded batch sizes graphs are made for."""
    out, b = [], 1
    while b < cap:
        out.append(b)
        b *= 2
    return [*out, cap]


def span_buckets(max_len: int) -> list[int]:
    """Key lengths an LM decode reads: MIN_SPAN, doubling, below `max_len`, then `max_len`."""
    out, s = [], MIN_SPAN
    while s < max_len:
        out.append(s)
        s *= 2
    return [*out, max_len]


def bucket_of(n: int, buckets: list[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclass
class _DecodeBuffers:
    inputs: torch.Tensor  # [B, 1, hidden]
    rows: torch.Tensor  # [2, B] long: slots, starts (device)
    staging: torch.Tensor  # [2, B] long on the host (pinned on CUDA)
    lengths: torch.Tensor  # [B] long, all ones
    out: torch.Tensor  # [B, hidden]


@dataclass
class _SampleBuffers:
    cond: torch.Tensor  # [B, hidden] model dtype
    history: torch.Tensor  # [B, H, C] float32
    noise: torch.Tensor  # [B, P, C] float32
    sde: torch.Tensor | None  # [steps, B, P, C] float32
    patch: torch.Tensor  # [B, P, C] float32
    next_input: torch.Tensor  # [B, hidden]
    stop: torch.Tensor  # [B] float32


class StepGraphs:
    """LM decode and CFM sample of up to `cap` rows on static buffers; CUDA graphs when `capture`."""

    def __init__(self, talker: TalkerModel, cache: KVSlots, plan: SamplePlan, *, cap: int, history_len: int,
                 patch: int, latent_dim: int, cfg_strength: float, sde_scale: float, capture: bool) -> None:
        self.talker, self.cache, self.plan = talker, cache, plan
        self.cap, self.cfg_strength, self.sde_scale = cap, cfg_strength, sde_scale
        self.capture = capture
        self.batches = batch_buckets(cap)
        self.spans = span_buckets(cache.max_len)
        p = next(talker.parameters())
        self.device, self.dtype = p.device, p.dtype
        hidden = talker.config.llm.hidden_size
        dev, steps = self.device, len(plan.dts)
        scratch = cache.num_slots
        self._decode: dict[int, _DecodeBuffers] = {}
        self._sample: dict[int, _SampleBuffers] = {}
        for b in self.batches:
            staging = torch.zeros(2, b, dtype=torch.long, pin_memory=dev.type == "cuda")
            rows = torch.zeros(2, b, dtype=torch.long, device=dev)
            rows[0] = scratch
            self._decode[b] = _DecodeBuffers(torch.zeros(b, 1, hidden, dtype=self.dtype, device=dev), rows, staging,
                                             torch.ones(b, dtype=torch.long, device=dev),
                                             torch.zeros(b, hidden, dtype=self.dtype, device=dev))
            f32 = dict(dtype=torch.float32, device=dev)
            self._sample[b] = _SampleBuffers(
                torch.zeros(b, hidden, dtype=self.dtype, device=dev), torch.zeros(b, history_len, latent_dim, **f32),
                torch.zeros(b, patch, latent_dim, **f32),
                torch.zeros(steps, b, patch, latent_dim, **f32) if sde_scale else None,
                torch.zeros(b, patch, latent_dim, **f32), torch.zeros(b, hidden, dtype=self.dtype, device=dev),
                torch.zeros(b, **f32))
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # graph replays (or eager runs of a body, without capture)

    # -- bodies: the work one graph holds -------------------------------------------------------

    def _decode_body(self, b: int, span: int) -> Callable[[], None]:
        buf = self._decode[b]
        rows = Rows(buf.rows[0], buf.rows[1], buf.lengths, span)

        def body() -> None:
            buf.out.copy_(self.talker.model(buf.inputs, self.cache, rows)[:, 0])

        return body

    def _sample_body(self, b: int) -> Callable[[], None]:
        buf = self._sample[b]

        def body() -> None:
            y = self.talker.dit.sample_planned(self.plan, buf.cond, buf.history, buf.noise, self.cfg_strength,
                                               buf.sde, self.sde_scale)
            buf.patch.copy_(y)
            buf.next_input.copy_(self.talker.aggregator(y))
            buf.stop.copy_(self.talker.stop_probability(buf.cond))

        return body

    def _run(self, key: tuple, body: Callable[[], None]) -> None:
        self.replays += 1
        if not self.capture:
            body()
            return
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._graphs[key] = self._capture(body)
        graph.replay()

    @torch.no_grad()
    def _capture(self, body: Callable[[], None]) -> torch.cuda.CUDAGraph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: cuBLAS handles, lazy inits
                body()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            body()
        return graph

    def capture_all(self) -> int:
        """Capture every (bucket) graph now, largest first (start-up: inside the memory budget); returns
        how many graphs exist. Padded rows only: the buffers point every LM row at the scratch slot."""
        if not self.capture:
            return 0
        for b in reversed(self.batches):
            self._decode[b].rows[0].fill_(self.cache.num_slots)
            self._decode[b].rows[1].zero_()
            for span in reversed(self.spans):
                key = ("decode", b, span)
                if key not in self._graphs:
                    self._graphs[key] = self._capture(self._decode_body(b, span))
            if ("sample", b) not in self._graphs:
                self._graphs[("sample", b)] = self._capture(self._sample_body(b))
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    # -- the runner's two calls -------------------------------------------------------------------

    def decode(self, slots: list[int], positions: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """`TalkerRunner.decode` on the padded buffers: [n, hidden] → [n, hidden] (a copy)."""
        n = len(slots)
        b = bucket_of(n, self.batches)
        span = bucket_of(max(positions) + 1, self.spans)
        buf = self._decode[b]
        buf.staging[0].fill_(self.cache.num_slots)
        buf.staging[1].zero_()
        buf.staging[0, :n] = torch.tensor(slots, dtype=torch.long)
        buf.staging[1, :n] = torch.tensor(positions, dtype=torch.long)
        buf.rows.copy_(buf.staging, non_blocking=True)
        buf.inputs[:n, 0].copy_(inputs)
        self._run(("decode", b, span), self._decode_body(b, span))
        return buf.out[:n].clone()

    def sample(self, hidden: torch.Tensor, history: torch.Tensor, noise: torch.Tensor,
               sde: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`TalkerRunner.sample`'s device work on the padded buffers → (patch, next inputs, stop) of the n
        real rows (copies). Padded rows keep whatever they held: rows never mix, so they are not read."""
        n = hidden.shape[0]
        b = bucket_of(n, self.batches)
        buf = self._sample[b]
        buf.cond[:n].copy_(hidden)
        buf.history[:n].copy_(history)
        buf.noise[:n].copy_(noise)
        if buf.sde is not None and sde is not None:
            buf.sde[:, :n].copy_(sde)
        self._run(("sample", b), self._sample_body(b))
        return buf.patch[:n].clone(), buf.next_input[:n].clone(), buf.stop[:n].clone()
