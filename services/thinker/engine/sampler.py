"""Next-token choice for the rows that sample: penalties, greedy or filtered random draw, logprobs.

The logits come in the model's dtype (bf16 serving: the LM head makes no fp32 copy). One rule here:
what reads logit values (penalties, grammar masks, temperature and top-k / top-p / min-p draws,
logprobs) reads their fp32 cast, made for the rows it needs; a greedy row's argmax reads the logits
as they are (the cast is exact and keeps the order: the same id, ties to the lowest index). So a
greedy step without penalties, masks or logprobs casts nothing. fp32 logits (the CPU reference)
are read as they are everywhere (their cast is the same tensor).

`Sampler.sample` only queues the device's work (no wait on the forward, so the host can go on and
plan the next step): its `DeviceSample` holds the ids and logprobs on the device, copied to the host
behind them; `DeviceSample.to_host` waits for that copy alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omnistage.services.thinker.engine.grammar_masks import PendingMask
from omnistage.services.thinker.engine.sequence import Sequence
from omnistage.services.thinker.kernels import triton_available


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


def on_device(values: list, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A host list as a tensor on `device` without waiting for the device's queue (a pinned source,
    copied asynchronously: a plain copy would wait for the forward queued before it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none
    # Row → why its request must end now (its grammar refused the sampled token or could not go on).
    ended: dict[int, str] = field(default_factory=dict)


def _repeats(seq: Sequence) -> bool:
    return seq.params.repetition_penalty != 1.0


def _present(seq: Sequence) -> bool:
    return seq.params.presence_penalty != 0.0 and seq.num_output_tokens > 0


def penalised(seq: Sequence) -> bool:
    """Whether `apply_penalties` changes this sequence's row."""
    return _repeats(seq) or _present(seq)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (prompt + output: positive logits divided, negative multiplied) and presence
    penalty (output tokens: subtracted), in place on float32 logits."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if _repeats(seq):
            seen = on_device(sorted(set(seq.token_ids)), logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if _present(seq):
            out = on_device(sorted(set(seq.output_token_ids)), logits.device)
            logits[i, out] -= p.presence_penalty
    return logits


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Set to -inf what top-k / top-p / min-p drop, per row (k=0, p=1, min_p=0 are off).

    In the order of HF's warpers and vLLM: top-k first, then top-p over the distribution renormalised
    to the k survivors, then min-p (relative to the top token, so renormalising does not change it).
    The most likely token always survives, so every row keeps a valid distribution.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[-1], device=logits.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k, logits.shape[-1])
    drop = rank >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Top-p drops a token when the mass from it down to the least likely is at most 1 - p (HF's form,
    # summed from the bottom: a top-down cumsum can round to 1 early and cut the tail when p = 1).
    mass_from_here = probs.flip(-1).cumsum(dim=-1).flip(-1)
    drop |= mass_from_here <= 1 - top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def fast_argmax(device: torch.device) -> bool:
    """Whether greedy ids on `device` may take the few-rows launch: a CUDA device with triton (under
    the interpreter the engine's CPU steps keep torch's: the kernel's own tests run it there)."""
    return device.type == "cuda" and triton_available()


def greedy_ids(logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(logits, dim=-1), into `out` when given: by the few-rows launch where it takes
    them (`fast_argmax`, kernels/argmax.py `supported`: many programs a row where torch's one CTA is
    slow), else torch's. triton is imported only where it runs. Any float dtype, read as it is:
    bf16 / fp16 rows give the ids of their fp32 cast (both argmaxes compare in fp32)."""
    if fast_argmax(logits.device):
        from omnistage.services.thinker.kernels import argmax

        if argmax.supported(logits, out):
            return argmax.argmax(logits, out)
    return logits.argmax(dim=-1) if out is None else torch.argmax(logits, dim=-1, out=out)


@dataclass
class TopLogprobs:
    """The logprobs rows of one step on the device: `rows` (those that asked), each row's `counts`."""

    rows: list[int]
    counts: list[int]
    chosen: torch.Tensor  # [k] the sampled token's logprob
    top_vals: torch.Tensor  # [k, n]
    top_ids: torch.Tensor  # [k, n]


@dataclass(eq=False)
class DeviceSample:
    """One step's sampled ids [R] (and logprobs) as the device makes them, and their host copies
    under way; `to_host` waits for the copies, then advances the constrained rows' grammars."""

    tokens: torch.Tensor
    logprobs: TopLogprobs | None
    mask: PendingMask | None
    _host: list[torch.Tensor] = field(default_factory=list)
    _copied: torch.cuda.Event | None = None

    def __post_init__(self) -> None:
        parts = [self.tokens]
        if self.logprobs is not None:
            lp = self.logprobs
            parts += [lp.chosen, lp.top_vals, lp.top_ids]
        if self.tokens.device.type == "cpu":  # copies: the tokens may be the feed's buffer (rewritten)
            self._host = [t.clone() for t in parts]
            return
        self._host = [t.to("cpu", non_blocking=True) for t in parts]  # pinned, behind the step's work
        self._copied = torch.cuda.Event()
        self._copied.record()

    def to_host(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        token_ids = self._host[0].tolist()
        result: list[TokenLogprobs | None] = [None] * len(token_ids)
        if self.logprobs is not None:
            chosen, top_vals, top_ids = (t.tolist() for t in self._host[1:])
            for j, (i, n) in enumerate(zip(self.logprobs.rows, self.logprobs.counts, strict=True)):
                result[i] = TokenLogprobs(token_ids[i], chosen[j], top_ids[j][:n], top_vals[j][:n])
        ended = self.mask.accept(token_ids) if self.mask is not None else {}
        return SamplerOutput(token_ids, result, ended)


class Sampler:
    """Samples one token per row of `logits` [R, V] for the given sequences; `mask`: the allowed
    tokens of their constrained rows (grammar_masks.py), filled while the forward ran."""

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: PendingMask | None = None
    ) -> SamplerOutput:
        """The step's tokens on the host (waits for the device)."""
        return self.sample(logits, seqs, mask).to_host()

    def sample(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        mask: PendingMask | None = None,
        out: torch.Tensor | None = None,
    ) -> DeviceSample:
        """The step's tokens, queued on the logits' device (a constrained row waits for its mask).
        `logits` [R, V] in the model's dtype, never changed (they may be a graph's output buffer).
        `out` (int64 [R]): where the greedy ids go (the sampled feed's buffer, `SampledFeed.target`);
        rows drawn at random replace theirs out of place, so the tokens are then a new tensor."""
        if logits.shape[0] != len(seqs):
            raise ValueError(f"sampler: {logits.shape[0]} logit rows for {len(seqs)} sequences")
        if out is not None and tuple(out.shape) != (len(seqs),):
            raise ValueError(f"sampler: ids out of shape {tuple(out.shape)} for {len(seqs)} sequences")
        if not seqs:
            return DeviceSample(torch.zeros(0, dtype=torch.int64, device=logits.device), None, None)
        changed = self._changed(logits, seqs, mask)
        chosen = logits if changed is None else changed
        tokens = greedy_ids(chosen, out)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        if random_rows:
            rows = on_device(random_rows, logits.device)
            drawn = self._draw(chosen[rows].float(), [seqs[i] for i in random_rows])
            tokens = tokens.index_put((rows,), drawn)
        return DeviceSample(tokens, self._logprobs(logits, seqs, tokens), mask)

    @staticmethod
    def _changed(logits: torch.Tensor, seqs: list[Sequence], mask: PendingMask | None) -> torch.Tensor | None:
        """An fp32 copy of the logits with the penalties and the grammar mask applied, where a row
        has either (the logprobs still read the model's logits); else None: the common step (greedy
        or plain draws) reads the logits as they are, no 4 bytes x vocab copy."""
        if mask is None and not any(penalised(s) for s in seqs):
            return None
        values = apply_penalties(logits.to(torch.float32, copy=True), seqs)
        if mask is not None:
            mask.apply(values)
        return values

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        def col(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return on_device([getattr(s.params, name) for s in seqs], logits.device, dtype)

        logits = logits / col("temperature")[:, None]
        logits = filter_logits(logits, col("top_k", torch.int64), col("top_p"), col("min_p"))
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each row's noise comes from its
        # own generator on the logits' device (no host draw, no copy), so the draw does not depend on
        # the batch. E is kept above 0 so a filtered token (p = 0) can never win with 0/0 = NaN.
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            noise[i].exponential_(generator=seq.generator(probs.device))
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: torch.Tensor) -> TopLogprobs | None:
        """The asking rows' logprobs: the log-softmax of their logits' fp32 cast (before penalties)."""
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs > 0]
        if not rows:
            return None
        index = on_device(rows, logits.device)
        logp = logits[index].float().log_softmax(dim=-1)
        counts = [seqs[i].params.logprobs for i in rows]
        top_vals, top_ids = logp.topk(min(max(counts), logp.shape[-1]), dim=-1)
        chosen = logp.gather(-1, tokens[index][:, None])[:, 0]
        return TopLogprobs(rows, counts, chosen, top_vals, top_ids)
