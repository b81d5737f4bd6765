"""The grammar's share of a step: which tokens each constrained row may take next, filled while the
forward runs (a thread of its own; xgrammar's batch fill spreads the rows over its threads without
the GIL), so the step waits only for what the forward did not cover; then the logits masked and
each sampled token accepted. A row whose grammar cannot go on is named, never kept going."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from omnistage.services.thinker.engine.grammar import Matcher, xgr


class Constrained(Protocol):
    matcher: Matcher | None


@dataclass(eq=False)
class PendingMask:
    """The allowed tokens of one step's constrained rows, being filled; `apply` waits for them."""

    rows: list[tuple[int, Matcher]]
    bitmask: torch.Tensor
    fill: concurrent.futures.Future
    # row → why its grammar cannot go on (it has ended, or its state could not say what may follow).
    broken: dict[int, str] = field(default_factory=dict)

    def apply(self, logits: torch.Tensor) -> None:
        """In place: -inf in each constrained row for every token its grammar does not allow now
        (and for columns past the tokenizer's vocabulary)."""
        self.broken.update(self.fill.result())
        x = xgr()
        rows = [i for i, _ in self.rows]
        vocab_size = self.rows[0][1].vocab_size
        bitmask = self.bitmask
        if logits.device.type != "cpu":
            bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
        width = min(vocab_size, logits.shape[-1])
        x.apply_token_bitmask_inplace(logits, bitmask, vocab_size=width, indices=rows)
        if logits.shape[-1] > vocab_size:
            logits[rows, vocab_size:] = float("-inf")

    def accept(self, token_ids: Sequence[int]) -> dict[int, str]:
        """Advance each constrained row by its sampled token; row → why the request must end (its
        grammar refused the token, or was broken before), for the rows that must."""
        ended = dict(self.broken)
        live = [(i, m) for i, m in self.rows if i not in ended]
        if not live:
            return ended
        tokens = [token_ids[i] for i, _ in live]
        accepted = xgr().BatchGrammarMatcher.batch_accept_token([m.state for _, m in live], tokens)
        for (i, _), token, ok in zip(live, tokens, accepted, strict=True):
            if not ok:
                ended[i] = f"sampling.constraint: the grammar refused the sampled token {token}"
        return ended


class GrammarMasks:
    """Starts each step's mask fill (`begin`, before the forward) on its own thread."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, "grammar-mask")
        self._batch: Any = None

    def begin(self, seqs: Sequence[Constrained]) -> PendingMask | None:
        """The fill of `seqs`' constrained rows, started; None when no row is constrained."""
        rows = [(i, s.matcher) for i, s in enumerate(seqs) if s.matcher is not None]
        if not rows:
            return None
        bitmask = xgr().allocate_token_bitmask(len(seqs), rows[0][1].vocab_size)
        return PendingMask(rows, bitmask, self._pool.submit(self._fill, rows, bitmask))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _fill(self, rows: list[tuple[int, Matcher]], bitmask: torch.Tensor) -> dict[int, str]:
        """Fill `bitmask`'s rows; row → why its grammar cannot go on, for the rows it cannot (their
        mask rows stay all-allowed: the token they sample is refused and the request ends)."""
        broken = {i: _ENDED for i, m in rows if m.state.is_terminated()}
        live = [(i, m) for i, m in rows if i not in broken]
        if not live:
            return broken
        if self._batch is None:
            self._batch = xgr().BatchGrammarMatcher("auto")
        try:
            self._batch.batch_fill_next_token_bitmask(
                [m.state for _, m in live], bitmask, [i for i, _ in live]
            )
        except RuntimeError:  # one row's state failed the whole batch: find it, fill the others
            for i, m in live:
                try:
                    m.state.fill_next_token_bitmask(bitmask, i)
                except RuntimeError as exc:
                    broken[i] = f"sampling.constraint: the grammar cannot say which tokens may follow: {exc}"
        return broken


_ENDED = "sampling.constraint: the grammar had already ended (its stop token was taken)"
