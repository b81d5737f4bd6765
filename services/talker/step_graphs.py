"""Static-shape talker steps: the LM decode, the whole CFM sample (Euler steps × CFG, aggregator, stop
head), the VAE decoder's Qwen2 and, at the prompt lengths asked for, the prefill of new segments run on
fixed buffers at padded sizes, captured as CUDA graphs on CUDA (issues 21, 38)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from omnistage.common.memory.device import fmt_bytes
from omnistage.services.talker.models.dit import SamplePlan
from omnistage.services.talker.models.qwen2 import KVSlots, Qwen2Stack, Rows
from omnistage.services.talker.models.talker_lm import TalkerModel

MIN_SPAN = 64


def batch_buckets(cap: int) -> list[int]:
    """1, 2, 4, … below `cap`, then `cap`: the padded batch sizes graphs are made for."""
    out, b = [], 1
    while b < cap:
        out.append(b)
        b *= 2
    return [*out, cap]


def _capture_error(exc: RuntimeError, device: torch.device) -> RuntimeError:
    """What a failed capture really was: an out-of-memory stays one (the stress then tries a smaller
    batch, or names the budget); anything else is its first error, with the device's memory."""
    first = exc.__context__ if isinstance(exc.__context__, RuntimeError) else exc
    if isinstance(first, torch.OutOfMemoryError):
        return torch.OutOfMemoryError(f"{first} (during a talker step-graph capture)")
    free, total = torch.cuda.mem_get_info(device)
    where = (
        f"device {fmt_bytes(free)} free of {fmt_bytes(total)}, this process "
        f"{fmt_bytes(torch.cuda.memory_reserved(device))} reserved"
    )
    line = (str(first).strip().splitlines() or [""])[0]
    return RuntimeError(f"talker step-graph capture failed ({where}): {line}")


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
class _StackBuffers:
    inputs: torch.Tensor  # [B, W, hidden]
    rows: torch.Tensor  # [3, B] long: slots, starts, lengths (device)
    staging: torch.Tensor  # [3, B] long on the host (pinned on CUDA)
    out: torch.Tensor  # [B, W, hidden]
    copied: torch.cuda.Event | None = None  # the last staging → device copy (the staging is reused after it)


class CachedStackGraphs:
    """A KV-cached Qwen2 stack (`Qwen2Stack` over `KVSlots`) at padded (rows, width, key span) buckets.

    Row i of a call writes its `lengths[i]` tokens at `starts[i]` of slot `slots[i]`; padded rows point
    at the scratch slot, padded columns of a row are written there too (as the eager path does), and
    keys are read up to the span bucket, masked past each row's end: the eager result. With `tie_span`
    (a prefill: every row from position 0) the span is the width bucket, one graph per width."""

    def __init__(
        self,
        stack: Qwen2Stack,
        cache: KVSlots,
        *,
        cap: int,
        widths: list[int],
        dtype: torch.dtype,
        device: torch.device,
        run: Callable[[tuple, Callable[[], None]], None],
        tie_span: bool = False,
    ) -> None:
        self.stack, self.cache, self.run = stack, cache, run
        self.batches, self.widths, self.spans = batch_buckets(cap), widths, span_buckets(cache.max_len)
        self.tie_span = tie_span
        hidden = stack.shape.hidden_size
        self._buf: dict[tuple[int, int], _StackBuffers] = {}
        for b in self.batches:
            for w in widths:
                rows = torch.zeros(3, b, dtype=torch.long, device=device)
                rows[0], rows[2] = cache.num_slots, 1
                self._buf[(b, w)] = _StackBuffers(
                    torch.zeros(b, w, hidden, dtype=dtype, device=device),
                    rows,
                    torch.zeros(3, b, dtype=torch.long, pin_memory=device.type == "cuda"),
                    torch.zeros(b, w, hidden, dtype=dtype, device=device),
                )

    def fits(self, n: int, width: int) -> bool:
        return n <= self.batches[-1] and width <= self.widths[-1]

    def body(self, b: int, w: int, span: int) -> Callable[[], None]:
        buf = self._buf[(b, w)]
        rows = Rows(buf.rows[0], buf.rows[1], buf.rows[2], span)

        def body() -> None:
            buf.out.copy_(self.stack(buf.inputs, self.cache, rows))

        return body

    def keys(self) -> list[tuple[int, int, int]]:
        """Every (rows, width, span) bucket, largest first (the capture order)."""
        return [
            (b, w, s)
            for b in reversed(self.batches)
            for w in reversed(self.widths)
            for s in ([w] if self.tie_span else reversed(self.spans))
        ]

    def park(self, b: int, w: int) -> None:
        """Point every row at the scratch slot (before a capture's warm-up runs)."""
        rows = self._buf[(b, w)].rows
        rows[0].fill_(self.cache.num_slots)
        rows[1].zero_()
        rows[2].fill_(1)

    def __call__(
        self, name: str, slots: list[int], starts: list[int], lengths: list[int], x: torch.Tensor
    ) -> torch.Tensor:
        """x [n, width, hidden] → the stack's output [n, width, hidden] (a copy)."""
        n, width = x.shape[0], x.shape[1]
        b, w = bucket_of(n, self.batches), bucket_of(width, self.widths)
        end = max(s + k for s, k in zip(starts, lengths, strict=True))
        span = w if self.tie_span else bucket_of(end, self.spans)
        buf = self._buf[(b, w)]
        if buf.copied is not None:  # done long ago in a served step (a sync came since): no wait in practice
            buf.copied.synchronize()
        buf.staging[0].fill_(self.cache.num_slots)
        buf.staging[1].zero_()
        buf.staging[2].fill_(1)
        buf.staging[:, :n] = torch.tensor([slots, starts, lengths], dtype=torch.long)
        buf.rows.copy_(buf.staging, non_blocking=True)
        if buf.rows.is_cuda:
            buf.copied = torch.cuda.Event()
            buf.copied.record()
        buf.inputs[:n, :width].copy_(x)
        self.run((name, b, w, span), self.body(b, w, span))
        return buf.out[:n, :width].clone()


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
    """LM decode, CFM sample and VAE backbone of up to `cap` rows on static buffers; CUDA graphs when
    `capture`."""

    def __init__(
        self,
        talker: TalkerModel,
        cache: KVSlots,
        plan: SamplePlan,
        *,
        cap: int,
        history_len: int,
        patch: int,
        latent_dim: int,
        cfg_strength: float,
        sde_scale: float,
        capture: bool,
        vae: tuple[Qwen2Stack, KVSlots, int] | None = None,
        prefill_widths: tuple[int, ...] = (),
    ) -> None:
        self.talker, self.cache, self.plan = talker, cache, plan
        self.cap, self.cfg_strength, self.sde_scale = cap, cfg_strength, sde_scale
        self.capture = capture
        self.batches = batch_buckets(cap)
        p = next(talker.parameters())
        self.device, self.dtype = p.device, p.dtype
        hidden = talker.config.llm.hidden_size
        dev, steps = self.device, len(plan.dts)
        self._graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = 0  # graph replays (or eager runs of a body, without capture)
        self.lm = self._stack_graphs(talker.model, cache, [1])
        # New segments' prompts prefilled together, at the prompt lengths asked for (tokens padded up).
        widths = sorted({w for w in prefill_widths if w <= cache.max_len})
        self.prefills = self._stack_graphs(talker.model, cache, widths, tie_span=True) if widths else None
        # The VAE decoder's backbone (stack, its cache, frames per step): widths of one step and two.
        self.vae = None if vae is None else self._stack_graphs(vae[0], vae[1], [vae[2], 2 * vae[2]])
        self._sample: dict[int, _SampleBuffers] = {}
        for b in self.batches:
            f32 = dict(dtype=torch.float32, device=dev)
            self._sample[b] = _SampleBuffers(
                torch.zeros(b, hidden, dtype=self.dtype, device=dev),
                torch.zeros(b, history_len, latent_dim, **f32),
                torch.zeros(b, patch, latent_dim, **f32),
                torch.zeros(steps, b, patch, latent_dim, **f32) if sde_scale else None,
                torch.zeros(b, patch, latent_dim, **f32),
                torch.zeros(b, hidden, dtype=self.dtype, device=dev),
                torch.zeros(b, **f32),
            )

    def _stack_graphs(
        self, stack: Qwen2Stack, cache: KVSlots, widths: list[int], *, tie_span: bool = False
    ) -> CachedStackGraphs:
        return CachedStackGraphs(
            stack,
            cache,
            cap=self.cap,
            widths=widths,
            dtype=self.dtype,
            device=self.device,
            run=self._run,
            tie_span=tie_span,
        )

    # -- bodies: the work one graph holds -------------------------------------------------------

    def _sample_body(self, b: int) -> Callable[[], None]:
        buf = self._sample[b]

        def body() -> None:
            y = self.talker.dit.sample_planned(
                self.plan, buf.cond, buf.history, buf.noise, self.cfg_strength, buf.sde, self.sde_scale
            )
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
        # This device made current for the calling thread (a start-up or device-loop thread starts on
        # cuda:0): a capture on another device's stream while the body runs on this one's legacy
        # stream fails ("operation not permitted when stream is capturing", seen on cuda:1).
        with torch.cuda.device(self.device):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(2):  # warm-up outside the graph: cuBLAS handles, lazy inits
                    body()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: the service's other threads (health, metrics, status) may call CUDA meanwhile
                with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
                    body()
            except RuntimeError as exc:  # an OOM inside the capture surfaces as capture_end's error
                raise _capture_error(exc, self.device) from exc
        return graph

    def capture_all(self) -> int:
        """Capture every bucket's graph now, largest first (start-up: inside the memory budget); returns
        how many graphs exist. The stacks' buffers point every row at the scratch slot meanwhile."""
        if not self.capture:
            return 0
        with torch.no_grad():
            for name, stacks in (("lm", self.lm), ("prefill", self.prefills), ("vae", self.vae)):
                if stacks is None:
                    continue
                for b, w, span in stacks.keys():
                    if (name, b, w, span) not in self._graphs:
                        stacks.park(b, w)
                        self._graphs[(name, b, w, span)] = self._capture(stacks.body(b, w, span))
            for b in reversed(self.batches):
                if ("sample", b) not in self._graphs:
                    self._graphs[("sample", b)] = self._capture(self._sample_body(b))
        torch.cuda.synchronize(self.device)
        return len(self._graphs)

    @property
    def graphs(self) -> int:
        return len(self._graphs)

    # -- the runner's calls -------------------------------------------------------------------

    def decode(self, slots: list[int], positions: list[int], inputs: torch.Tensor) -> torch.Tensor:
        """`TalkerRunner.decode` on the padded buffers: [n, hidden] → [n, hidden] (a copy)."""
        return self.lm("lm", slots, positions, [1] * len(slots), inputs[:, None])[:, 0]

    def prefill(self, slots: list[int], embeddings: list[torch.Tensor]) -> torch.Tensor | None:
        """`TalkerRunner.prefill_batch` on the padded buffers: each prompt's last hidden state [n, hidden];
        None where the prompts are more or longer than the buckets (the caller prefills eagerly)."""
        lengths = [e.shape[0] for e in embeddings]
        if self.prefills is None or not self.prefills.fits(len(slots), max(lengths)):
            return None
        x = torch.nn.utils.rnn.pad_sequence(embeddings, batch_first=True)
        out = self.prefills("prefill", slots, [0] * len(slots), lengths, x)
        last = torch.tensor(lengths, device=out.device) - 1
        return out[torch.arange(len(slots), device=out.device), last]

    def vae_backbone(
        self, x: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]
    ) -> torch.Tensor:
        """The VAE decoder's Qwen2 over a step's frames (`VAEDecoder.decode_step`'s backbone); eager where
        the step is wider or larger than the buckets."""
        assert self.vae is not None
        if not self.vae.fits(x.shape[0], x.shape[1]):
            return self.vae.stack(x, self.vae.cache, Rows.of(slots, starts, lengths, x.device))
        return self.vae("vae", slots, starts, lengths, x)

    def sample(
        self, hidden: torch.Tensor, history: torch.Tensor, noise: torch.Tensor, sde: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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
