"""Next-token choice for the rows that sample: penalties, greedy or filtered random draw, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from omnistage.services.thinker.engine.grammar_masks import PendingMask
from omnistage.services.thinker.engine.sequence import Sequence


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row; None where the request asked for none
    # Row → why its request must end now (its grammar refused the sampled token or could not go on).
    ended: dict[int, str] = field(default_factory=dict)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """Repetition penalty (prompt + output: positive logits divided, negative multiplied) and presence
    penalty (output tokens: subtracted), in place on float32 logits."""
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if p.presence_penalty != 0.0 and seq.num_output_tokens:
            out = torch.tensor(sorted(set(seq.output_token_ids)), dtype=torch.long, device=logits.device)
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


class Sampler:
    """Samples one token per row of `logits` [R, V] for the given sequences; `mask`: the allowed
    tokens of their constrained rows (grammar_masks.py), filled while the forward ran."""

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], mask: PendingMask | None = None
    ) -> SamplerOutput:
        if logits.shape[0] != len(seqs):
            raise ValueError(f"sampler: {logits.shape[0]} logit rows for {len(seqs)} sequences")
        if not seqs:
            return SamplerOutput([], [])
        raw = logits.float()
        logits = apply_penalties(raw.clone(), seqs)
        if mask is not None:
            mask.apply(logits)
        greedy = logits.argmax(dim=-1)
        random_rows = [i for i, s in enumerate(seqs) if not s.params.is_greedy]
        tokens = greedy
        if random_rows:
            tokens = greedy.clone()
            tokens[random_rows] = self._draw(logits[random_rows], [seqs[i] for i in random_rows])
        token_ids = tokens.tolist()
        ended = mask.accept(token_ids) if mask is not None else {}
        return SamplerOutput(token_ids, self._logprobs(raw, seqs, token_ids), ended)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        def col(values: list) -> torch.Tensor:
            return torch.tensor(values, device=logits.device)

        logits = logits / col([s.params.temperature for s in seqs])[:, None]
        logits = filter_logits(
            logits,
            col([s.params.top_k for s in seqs]),
            col([s.params.top_p for s in seqs]),
            col([s.params.min_p for s in seqs]),
        )
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p. Each row's noise comes from its
        # own generator on the logits' device (no host draw, no copy), so the draw does not depend on
        # the batch. E is kept above 0 so a filtered token (p = 0) can never win with 0/0 = NaN.
        noise = torch.empty_like(probs)
        for i, seq in enumerate(seqs):
            noise[i].exponential_(generator=seq.generator(probs.device))
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(self, raw: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs > 0]
        result: list[TokenLogprobs | None] = [None] * len(seqs)
        if not rows:
            return result
        logp = raw[rows].log_softmax(dim=-1)
        top_n = max(seqs[i].params.logprobs for i in rows)
        top_vals, top_ids = logp.topk(min(top_n, logp.shape[-1]), dim=-1)
        chosen = logp.gather(-1, torch.tensor([[token_ids[i]] for i in rows], device=logp.device))
        for j, i in enumerate(rows):
            n = seqs[i].params.logprobs
            result[i] = TokenLogprobs(
                token_id=token_ids[i],
                logprob=float(chosen[j, 0]),
                top_token_ids=top_ids[j, :n].tolist(),
                top_logprobs=top_vals[j, :n].tolist(),
            )
        return result
