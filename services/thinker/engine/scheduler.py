"""Continuous batching: each step mixes decodes and prefill chunks within the token and sequence budgets."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from omnistage.services.thinker.engine.block_manager import BlockManager
from omnistage.services.thinker.engine.config import ResolvedEngineConfig
from omnistage.services.thinker.engine.sequence import FinishReason, Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """One step: `scheduled` = (sequence, tokens to compute) in batch order."""

    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Sequences scheduled for the first time this step (their queue time ends; not readmissions).
    admitted: list[Sequence] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    # Sequences that reach their last known token this step, hence sample one, in batch order.
    sampling_seqs: list[Sequence] = field(default_factory=list)
    # Hidden-state requests whose prompt completes this step: they end after it, sampling nothing.
    completing_hidden: list[Sequence] = field(default_factory=list)


class Scheduler:
    """Owns the waiting queue, the running set and the block manager."""

    def __init__(self, cfg: ResolvedEngineConfig, eos_token_ids: Iterable[int]) -> None:
        self.cfg = cfg
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(cfg.num_kv_blocks, cfg.block_size, cfg.prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.seqs: dict[str, Sequence] = {}

    def add(self, seq: Sequence) -> None:
        """Queue a sequence whose budget its request's maker checked (asserted here)."""
        assert seq.request_id not in self.seqs, f"request {seq.request_id!r} is already in the engine"
        assert seq.num_prompt_tokens + seq.max_tokens <= self.cfg.max_model_len, (
            seq.request_id,
            seq.max_tokens,
        )
        self.seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a queued or running request now; its blocks are free when this returns."""
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.media = None  # its encoder rows go with it
        seq.drop_pending()
        self.block_manager.free(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.seqs.pop(seq.request_id, None)

    def schedule(self) -> ScheduledBatch:
        """Decodes first, then prompt work within what is left: the running sequences' next chunks in
        order, then new admissions in arrival order (every request that arrived since the last step
        and fits the budgets joins this one). While any sequence decodes, prompt work is capped at
        `prefill_tokens_while_decoding` (chunked prefill only): a long prompt costs the streams a few
        bounded steps instead of one long one, and a decode never waits for a budget."""
        batch = ScheduledBatch()
        self.running.sort(key=lambda s: s.num_uncomputed_tokens != 1)  # stable: decodes first, in order
        budget = self._schedule_running(batch)
        if not batch.preempted:
            self._admit(batch, budget)
        for seq, n in batch.scheduled:
            if seq.num_computed_tokens + n == seq.num_tokens:
                (batch.completing_hidden if seq.wants_hidden_states else batch.sampling_seqs).append(seq)
        return batch

    def _schedule_running(self, batch: ScheduledBatch) -> int:
        """Each running sequence its next tokens, in order, within the step's budgets; when the cache
        has no room the youngest running sequences are preempted (recomputed later), possibly the
        sequence itself. Returns the prompt tokens left for admissions."""
        budget = self.cfg.max_num_batched_tokens
        capped = False
        queue = list(self.running)
        kept: list[Sequence] = []
        while queue:
            seq = queue.pop(0)
            kept.append(seq)
            if self._ends_in_flight(seq):
                continue  # nothing to compute: the step in flight ends it (it holds its blocks till then)
            if not capped and seq.num_uncomputed_tokens != 1:  # the first prompt chunk: decodes are done
                budget, capped = self._prompt_budget(batch, budget), True
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0:
                continue  # out of token budget: stays running, holds its blocks
            while not self.block_manager.can_allocate(seq, num_new):
                victim = queue.pop() if queue else kept.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.block_manager.allocate(seq, num_new)
            batch.scheduled.append((seq, num_new))
            budget -= num_new
        self.running = kept
        return budget if capped else self._prompt_budget(batch, budget)

    def _ends_in_flight(self, seq: Sequence) -> bool:
        """A launched step ends it whatever it samples: its hidden states are all computed, or its
        pending token is its last (max_tokens, max_model_len)."""
        if seq.num_uncomputed_tokens == 0:
            return True
        return seq.num_pending > 0 and self._at_length(seq, seq.num_tokens)

    def _prompt_budget(self, batch: ScheduledBatch, budget: int) -> int:
        """The tokens prompt work may take this step, once the decodes are scheduled."""
        cap = self.cfg.prefill_tokens_while_decoding
        if cap and batch.scheduled and self.cfg.chunked_prefill:
            return min(budget, cap)
        return budget

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            assert not seq.num_pending, f"{seq.request_id} admitted with a token still pending"
            blocks = self.block_manager
            prefix = blocks.match_prefix(seq)
            num_new = seq.num_tokens - len(prefix) * blocks.block_size
            if num_new > budget:
                if not self.cfg.chunked_prefill:
                    break
                num_new = budget
            if not blocks.can_admit(seq, prefix, num_new):
                break
            self.waiting.popleft()
            blocks.record_lookup(seq, len(prefix))
            blocks.take_prefix(seq, prefix)
            blocks.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                seq.num_cached_prompt_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
                batch.admitted.append(seq)
            self.running.append(seq)
            batch.scheduled.append((seq, num_new))
            budget -= num_new

    def _preempt(self, seq: Sequence) -> None:
        """Free the sequence's cache and requeue it first; its tokens are recomputed when readmitted."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def advance(self, batch: ScheduledBatch) -> None:
        """The batch is launched: its tokens count as computed (their K/V are being written), and each
        sampling sequence holds a placeholder for its token, row by row (`sequence.placeholder`), so the
        next step can be scheduled before the ids reach the host."""
        for seq, num_new in batch.scheduled:
            seq.num_computed_tokens += num_new
        for row, seq in enumerate(batch.sampling_seqs):
            seq.add_pending(row)

    def postprocess(self, batch: ScheduledBatch, sampled: list[int]) -> list[Sequence]:
        """The advanced batch's ids are on the host (in `sampling_seqs` order): each live sequence's
        placeholder takes its token, newly computed full blocks are indexed, token stops apply; the
        hidden-state requests whose prompt is now computed end (their KV blocks are freed here). A
        sequence that ended while the step ran (aborted, or stopped by its previous token) is skipped:
        its token is dropped.

        Returns the sequences that finished here.
        """
        sampling = batch.sampling_seqs
        if len(sampling) != len(sampled):
            raise ValueError(f"postprocess: {len(sampling)} sampling sequences, {len(sampled)} tokens")
        live = [
            (seq, token_id) for seq, token_id in zip(sampling, sampled, strict=True) if not seq.is_finished
        ]
        num_tokens = [seq.resolve_pending(token_id) for seq, token_id in live]
        for seq, _ in batch.scheduled:
            if not seq.is_finished:
                self.block_manager.index_computed(seq)
        finished = []
        for seq in batch.completing_hidden:
            if not seq.is_finished:
                self.finish(seq, FinishReason.STOP)
                finished.append(seq)
        for (seq, token_id), n in zip(live, num_tokens, strict=True):
            reason = self._stop_reason(seq, token_id, n)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def _stop_reason(self, seq: Sequence, token_id: int, num_tokens: int) -> FinishReason | None:
        """Why the sequence ends with `token_id`, its token number `num_tokens`, if it does."""
        if token_id in seq.params.stop_token_ids:
            return FinishReason.STOP
        if token_id in self.eos_token_ids and not seq.params.ignore_eos:
            return FinishReason.STOP
        if self._at_length(seq, num_tokens):
            return FinishReason.LENGTH
        return None

    def _at_length(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens are all the sequence may have (max_tokens, max_model_len)."""
        return num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= self.cfg.max_model_len
