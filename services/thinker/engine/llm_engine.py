"""LLMEngine: the only API the thinker server uses (add_request / step / abort), on TP rank 0.

One step is the five-line story: schedule, launch (the plan broadcast to all ranks, the forward and
the sampling queued on the device), then complete: the ids on the host, postprocess (token stops,
max_tokens), emit (detokenized deltas, stop strings, usage). With async scheduling
(`engine.async_scheduling`) a step completes while the next one runs: the next is scheduled and
launched with its decodes' new ids still on the device (placeholders the runner fills there), so
the host's work is off the device's critical path. Hidden-state requests (image generation's
conditioning) ride along: their chunks keep the final-norm rows of their slots, and when their
prompt is computed they end (KV blocks freed) with those rows in their output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol, TypeVar

import torch
from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.budget import RequestBudget
from omnistage.services.thinker.engine.config import ResolvedEngineConfig, async_scheduling_on
from omnistage.services.thinker.engine.detokenizer import Decoder
from omnistage.services.thinker.engine.grammar_masks import GrammarMasks, PendingMask
from omnistage.services.thinker.engine.hidden_states import HiddenCapture
from omnistage.services.thinker.engine.media import Prompt, PromptMedia, unpack_prompt
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.outputs import (
    Emitter,
    GenerateResult,
    RequestOutput,
    Usage,
    final_output,
)
from omnistage.services.thinker.engine.sampler import DeviceSample, Sampler, SamplerOutput
from omnistage.services.thinker.engine.scheduler import ScheduledBatch, Scheduler
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams, Sequence
from omnistage.services.thinker.engine.step_plan import build_step_plan
from omnistage.services.thinker.tp.distributed import TPControl, TPError
from omnistage.services.thinker.tp.plan import StepPlan

__all__ = ["GenerateResult", "LLMEngine", "RequestOutput", "Usage"]

log = get_logger(__name__)
T = TypeVar("T")


@dataclass
class StepTimes:
    """Where one `step()` call's host time went, in seconds per phase: schedule, plan (built and sent
    to the TP group), launch (the forward's kernels queued: on a GPU the device runs on behind it),
    sample (the sampling queued), wait (for the sampled ids of the step completed: where a step's
    device time ends), output (stops, detokenize, emit). With async scheduling the first four are
    the step launched and the last two the step before it."""

    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started


class StepObserver(Protocol):
    """Told what each step did (rank 0, engine thread; after the step's outputs are made)."""

    def on_step(self, batch: ScheduledBatch, now: float) -> None:
        """`batch` as completed: its sampling and completing hidden-state sequences are those that got
        their output (a sequence that ended while the step ran is left out)."""

    def on_abort(self, seq: Sequence, now: float) -> None: ...


@dataclass(eq=False)
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `ahead`: the next step may be
    planned before its ids reach the host (no sequence of it needs them there first)."""

    batch: ScheduledBatch
    sample: DeviceSample | None = None
    ahead: bool = False


class LLMEngine:
    """Scheduler + runner + sampler + detokenizers, driven one step at a time by one thread."""

    def __init__(
        self,
        runner: ModelRunner,
        tokenizer: Decoder,
        eos_token_ids: list[int],
        control: TPControl | None = None,
    ) -> None:
        self.cfg: ResolvedEngineConfig = runner.cfg
        self.runner = runner
        self.tokenizer = tokenizer
        self.control = control or TPControl()
        self.scheduler = Scheduler(self.cfg, eos_token_ids)
        self.sampler = Sampler()
        self.grammar_masks = GrammarMasks()
        self.emitter = Emitter(tokenizer, self.scheduler.finish)
        self.async_scheduling = async_scheduling_on(self.cfg.async_scheduling, runner.device)
        self.in_flight: LaunchedStep | None = None  # launched, not completed (async scheduling)
        # Idle workers wait for the next plan within the serving collective deadline: a no-op plan
        # every quarter of it keeps them from timing out.
        self.keepalive_s = min(30.0, self.control.cfg.serving_collective_timeout_s / 4)
        self.last_plan_time = time.monotonic()
        self.num_steps = 0
        self.closed = False
        # What each step did, for metrics (engine_metrics.py); None: nothing is recorded.
        self.stats: StepObserver | None = None
        self.step_times = StepTimes()  # the last step's phases (metrics, the profile benchmark)
        self._generate_ids = itertools.count()

    # --- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        budget: RequestBudget,
        positions: torch.Tensor | None = None,
        rope_delta: int = 0,
        media: PromptMedia | None = None,
        hidden_slots: torch.Tensor | None = None,
    ) -> None:
        """Queue a request whose `budget` its maker computed (`RequestBudget.of`: the context rule is
        checked there, only asserted here). For a multimodal prompt, `positions` [3, P] and
        `rope_delta` come from rope_index and `media` holds the encoder rows that replace its
        placeholder embeddings. `hidden_slots` [N] (prompt positions) makes it a hidden-state request:
        no token is sampled, its final output carries the final-norm hidden states at those slots.
        How many may wait is the request flow's admission (max_num_seqs + max_queued_requests)."""
        num_prompt = len(prompt_token_ids)
        assert budget.holds(num_prompt, self.cfg.max_model_len), (request_id, budget, num_prompt)
        assert positions is None or tuple(positions.shape) == (3, num_prompt), "positions must be [3, P]"
        assert media is None or not media.num_rows or _inside(media.slots, num_prompt), "media slots"
        assert hidden_slots is None or _inside(hidden_slots, num_prompt), "hidden-state slots"
        assert request_id not in self.scheduler.seqs, f"request {request_id!r} is already running"
        hidden = HiddenCapture(hidden_slots) if hidden_slots is not None else None
        seq = Sequence(
            request_id, prompt_token_ids, params, budget.max_tokens, rope_delta, positions, media, hidden
        )
        self.scheduler.add(seq)
        if hidden is None:  # a hidden-state request has no tokens to detokenize
            self.emitter.add(request_id, prompt_token_ids, params)

    def budget(self, prompt: Prompt, params: SamplingParams) -> RequestBudget:
        """The budget of a request made here (`generate`, tests, benchmarks) against this engine's
        context; RequestError when it cannot fit."""
        token_ids, extra = unpack_prompt(prompt)
        return RequestBudget.of(
            len(token_ids),
            params.max_tokens,
            self.cfg.max_model_len,
            self.cfg.default_max_tokens,
            hidden_states="hidden_slots" in extra,
        )

    def add_prompt(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None) -> None:
        """Queue a plain or multimodal prompt made here: its budget computed, then `add_request`."""
        params = params or SamplingParams()
        token_ids, extra = unpack_prompt(prompt)
        self.add_request(request_id, token_ids, params, self.budget(prompt, params), **extra)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; its final output (ABORT, usage so far), or None
        if it is unknown or already finished. Text held back for a stop string is dropped, and so is
        a token a launched step samples for it."""
        self.emitter.drop(request_id)
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if self.stats is not None:
            self.stats.on_abort(seq, time.monotonic())
        return final_output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.in_flight is not None

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step, then complete one: with async scheduling the one launched
        before (its outputs are this call's, while the new one runs), else (or when a sequence needs
        its ids on the host before its next draw) the one just launched."""
        self.step_times = times = StepTimes()
        launched = self._launch(times.timed("schedule", self.scheduler.schedule))
        previous, self.in_flight = self.in_flight, None
        outputs = self._complete(previous) if previous is not None else []
        if launched.ahead:
            self.in_flight = launched
        elif launched.batch.scheduled or launched.batch.preempted:  # else there is nothing to tell
            outputs += self._complete(launched)
        return outputs

    def _launch(self, batch: ScheduledBatch) -> LaunchedStep:
        """Plan, broadcast, forward and sample `batch` without waiting for the device; then its
        tokens count as computed and each sampling sequence holds a placeholder for its id."""
        if batch.is_empty:
            return LaunchedStep(batch)
        seqs = batch.sampling_seqs
        ahead = self.async_scheduling and not any(s.needs_tokens_on_host for s in seqs)
        mask = self.grammar_masks.begin(seqs)  # filled while the forward runs

        def sent() -> StepPlan:  # a failed broadcast is reported to the group inside (TPError)
            plan = build_step_plan(batch.scheduled, self.cfg.block_size)
            plan.share_sampled = ahead and bool(seqs)
            return self.control.broadcast_plan(plan)

        plan = self.step_times.timed("plan", sent)
        self.last_plan_time = time.monotonic()
        self.num_steps += 1
        sample = self._forward(plan, batch, mask)
        self.scheduler.advance(batch)
        return LaunchedStep(batch, sample, ahead)

    def _forward(
        self, plan: StepPlan, batch: ScheduledBatch, mask: PendingMask | None
    ) -> DeviceSample | None:
        """The plan's forward and its sampling, queued; its ids shared with every rank's device when
        the next plan may name them."""
        times = self.step_times
        out = self._on_every_rank(lambda: times.timed("launch", lambda: self.runner.execute_step(plan)))
        self._keep_hidden(batch, out.hidden)
        if out.logits is None:
            return None
        logits = out.logits

        def draw() -> DeviceSample:
            target = self.runner.sample_target(plan) if plan.share_sampled else None
            sample = self.sampler.sample(logits, batch.sampling_seqs, mask, out=target)
            if plan.share_sampled:  # nothing to copy where the ids were sampled into `target`
                self.runner.share_sampled(plan, sample.tokens)
            return sample

        # The ranks wait for the ids it shares: a failure there must end the group, not strand them.
        return times.timed("sample", lambda: self._on_every_rank(draw) if plan.share_sampled else draw())

    def _on_every_rank(self, fn: Callable[[], T]) -> T:
        """`fn` runs what every rank runs for this plan; a failure ends the group, every rank leaving
        with its first diagnostic."""
        try:
            return fn()
        except Exception as exc:
            raise TPError(self.control.fail(f"step {self.control.num_plans - 1} forward", exc)) from exc

    def _complete(self, step: LaunchedStep) -> list[RequestOutput]:
        """The step's ids on the host: token stops, detokenized outputs, hidden-state ends. Sequences
        that ended while it ran (aborted, or stopped by their previous token) get nothing."""
        times, batch = self.step_times, step.batch
        sample = step.sample
        sampled = times.timed("wait", lambda: sample.to_host() if sample else SamplerOutput([], []))
        started = time.perf_counter()
        seqs = batch.sampling_seqs
        live = [i for i, seq in enumerate(seqs) if not seq.is_finished]
        completing = [seq for seq in batch.completing_hidden if not seq.is_finished]
        self.scheduler.postprocess(batch, sampled.token_ids)
        for i, why in sampled.ended.items():  # its grammar cannot go on: ended, never kept going
            if i in live:
                self.scheduler.finish(seqs[i], FinishReason.ERROR)
                seqs[i].finish_reason, seqs[i].error = FinishReason.ERROR, why
        now = time.monotonic()
        outputs = self.emitter.tokens(
            [(seqs[i], sampled.token_ids[i], sampled.logprobs[i]) for i in live], now
        )
        outputs += [self.emitter.hidden(seq, now) for seq in completing]
        times.seconds["output"] = times.seconds.get("output", 0.0) + time.perf_counter() - started
        if self.stats is not None:
            delivered = [seqs[i] for i in live]
            self.stats.on_step(replace(batch, sampling_seqs=delivered, completing_hidden=completing), now)
        return outputs

    @staticmethod
    def _keep_hidden(batch: ScheduledBatch, hidden: torch.Tensor | None) -> None:
        """Hand each hidden-state request the rows its chunk covered (the plan's hidden_index order)."""
        taken = 0
        for seq, n in batch.scheduled:
            if seq.hidden is None:
                continue
            lo, hi = seq.hidden.span(seq.num_computed_tokens, seq.num_computed_tokens + n)
            if hi > lo:
                assert hidden is not None, "the step kept no hidden rows for a chunk that covers query slots"
                seq.hidden.store(lo, hidden[taken : taken + hi - lo])
                taken += hi - lo

    # --- TP housekeeping ------------------------------------------------------------------------

    def keepalive(self) -> None:
        """Call while idle: sends a no-op plan when workers have waited `keepalive_s` for one."""
        if self.control.is_distributed and time.monotonic() - self.last_plan_time >= self.keepalive_s:
            self.control.broadcast_plan(StepPlan.noop())
            self.last_plan_time = time.monotonic()

    def shutdown(self) -> None:
        """Send the exit plan (workers return) and leave the group; safe to call twice. After a
        failure of the group no plan is sent: the group is broken, and every rank is leaving."""
        if self.closed:
            return
        self.closed = True
        self.in_flight = None  # its outputs go nowhere now
        self.grammar_masks.close()
        if self.control.is_distributed and self.control.failure is None:
            try:
                self.control.broadcast_plan(StepPlan.exit())
            except TPError as exc:
                log.error("exit plan not delivered: %s", exc)
        self.control.close()

    # --- convenience ----------------------------------------------------------------------------

    def generate(
        self,
        prompts: list[Prompt],
        params: SamplingParams | list[SamplingParams] | None = None,
        timeout_s: float = 600.0,
    ) -> list[GenerateResult]:
        """Run prompts (token ids or MultimodalPrompts) to completion (tests, benchmarks); results in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"generate-{next(self._generate_ids)}" for _ in prompts]
        for rid, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_prompt(rid, prompt, p)
        results = {rid: GenerateResult(rid, [], "", FinishReason.ERROR) for rid in ids}
        deadline = time.monotonic() + timeout_s
        while self.has_unfinished():
            if time.monotonic() > deadline:
                pending = [r for r in ids if r in self.scheduler.seqs]
                raise TimeoutError(f"generate: requests {pending[:5]} unfinished after {timeout_s:.0f}s")
            for out in self.step():
                res = results[out.request_id]
                res.token_ids += out.token_ids
                res.text += out.text
                res.logprobs += out.logprobs
                if out.finished:
                    res.finish_reason, res.message = out.finish_reason, out.message
                    res.hidden_states, res.usage = out.hidden_states, out.usage
        return [results[rid] for rid in ids]


def _inside(slots: torch.Tensor, num_prompt: int) -> bool:
    """Whether every (sorted) slot is a position of a prompt of `num_prompt` tokens."""
    return slots.numel() > 0 and 0 <= int(slots.min()) <= int(slots.max()) < num_prompt
