"""LLMEngine: the only API the thinker server uses (add_request / step / abort), on TP rank 0.

One step is the five-line story: schedule, run (plan broadcast to all ranks), sample, postprocess
(token stops, max_tokens), emit (detokenized deltas, stop strings, usage). Hidden-state requests
(image generation's conditioning) ride along: their chunks keep the final-norm rows of their slots,
and when their prompt is computed they end (KV blocks freed) with those rows in their output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.budget import RequestBudget
from omnistage.services.thinker.engine.config import ResolvedEngineConfig
from omnistage.services.thinker.engine.detokenizer import Decoder, Detokenizer
from omnistage.services.thinker.engine.grammar_masks import GrammarMasks
from omnistage.services.thinker.engine.hidden_states import HiddenCapture
from omnistage.services.thinker.engine.media import Prompt, PromptMedia, unpack_prompt
from omnistage.services.thinker.engine.model_runner import ModelRunner, StepOutput
from omnistage.services.thinker.engine.sampler import Sampler, SamplerOutput, TokenLogprobs
from omnistage.services.thinker.engine.scheduler import ScheduledBatch, Scheduler
from omnistage.services.thinker.engine.sequence import FinishReason, SamplingParams, Sequence
from omnistage.services.thinker.engine.step_plan import build_step_plan
from omnistage.services.thinker.tp.distributed import TPControl, TPError
from omnistage.services.thinker.tp.plan import StepPlan

log = get_logger(__name__)
T = TypeVar("T")


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    time_to_first_token_ms: float
    cached_prompt_tokens: int = 0  # prompt tokens taken from the prefix cache at the first admission


@dataclass
class RequestOutput:
    """What one request gained in one step (or its end)."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finished: bool = False
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    message: str = ""  # why a request ended with FinishReason.ERROR
    # Hidden-state mode, in the final output: [N, H] final-norm rows at the request's slots (rank 0's device).
    hidden_states: torch.Tensor | None = None


@dataclass
class GenerateResult:
    """A whole request's output (generate())."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    hidden_states: torch.Tensor | None = None
    message: str = ""  # why it ended with FinishReason.ERROR


@dataclass
class StepTimes:
    """Where one step's host time went, in seconds per phase: schedule, plan (built and sent to the TP
    group), launch (the forward's kernels queued: on a GPU the device runs on behind it), sample
    (waits for the device's logits, then picks the tokens), output (stops, detokenize, emit)."""

    seconds: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, fn: Callable[[], T]) -> T:
        started = time.perf_counter()
        try:
            return fn()
        finally:
            self.seconds[phase] = time.perf_counter() - started


class StepObserver(Protocol):
    """Told what each step did (rank 0, engine thread; after the step's outputs are made)."""

    def on_step(self, batch: ScheduledBatch, now: float) -> None: ...

    def on_abort(self, seq: Sequence, now: float) -> None: ...


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
        self.detokenizers: dict[str, Detokenizer] = {}
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
            self.detokenizers[request_id] = Detokenizer(
                self.tokenizer, prompt_token_ids, params.stop, keep_special=params.keep_special_tokens
            )

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
        if it is unknown or already finished. Text held back for a stop string is dropped."""
        self.detokenizers.pop(request_id, None)
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        if self.stats is not None:
            self.stats.on_abort(seq, time.monotonic())
        return RequestOutput(
            request_id, [], "", finished=True, finish_reason=FinishReason.ABORT, usage=self._usage(seq)
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        times = self.step_times = StepTimes()
        batch = times.timed("schedule", self.scheduler.schedule)
        mask = self.grammar_masks.begin(batch.sampling_seqs)  # filled while the forward runs
        out = self._run(batch)
        sampled = times.timed(
            "sample",
            lambda: (
                self.sampler(out.logits, batch.sampling_seqs, mask)
                if out.logits is not None
                else SamplerOutput([], [])
            ),
        )
        started = time.perf_counter()
        self._keep_hidden(batch, out.hidden)
        self.scheduler.postprocess(batch, sampled.token_ids)
        for i, why in sampled.ended.items():  # its grammar cannot go on: ended, never kept going
            seq = batch.sampling_seqs[i]
            self.scheduler.finish(seq, FinishReason.ERROR)
            seq.finish_reason, seq.error = FinishReason.ERROR, why
        now = time.monotonic()
        outputs = self._emit(batch.sampling_seqs, sampled, now)
        outputs += [self._hidden_output(s, now) for s in batch.completing_hidden]
        times.seconds["output"] = time.perf_counter() - started
        if self.stats is not None:
            self.stats.on_step(batch, now)
        return outputs

    def _run(self, batch: ScheduledBatch) -> StepOutput:
        if batch.is_empty:
            return StepOutput()
        times = self.step_times
        # A failed broadcast is reported to the group inside broadcast_plan (TPError).
        plan = times.timed(
            "plan", lambda: self.control.broadcast_plan(build_step_plan(batch.scheduled, self.cfg.block_size))
        )
        self.last_plan_time = time.monotonic()
        self.num_steps += 1
        try:
            return times.timed("launch", lambda: self.runner.execute_step(plan))
        except Exception as exc:  # every rank leaves with the group's first diagnostic
            raise TPError(self.control.fail(f"step {self.control.num_plans - 1} forward", exc)) from exc

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

    def _hidden_output(self, seq: Sequence, now: float) -> RequestOutput:
        """The final output of a hidden-state request whose prompt is now computed (blocks freed)."""
        seq.first_token_time = now  # "first output": the states are ready
        rows, seq.hidden = seq.hidden.rows if seq.hidden is not None else None, None
        return RequestOutput(
            seq.request_id,
            [],
            "",
            finished=True,
            finish_reason=seq.finish_reason,
            usage=self._usage(seq),
            hidden_states=rows,
        )

    def _emit(self, seqs: list[Sequence], sampled: SamplerOutput, now: float) -> list[RequestOutput]:
        outputs = []
        for seq, token_id, logprobs in zip(seqs, sampled.token_ids, sampled.logprobs, strict=True):
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.prev_token_time, seq.last_token_time = seq.last_token_time, now
            if seq.error:  # the refused token is not shown
                del self.detokenizers[seq.request_id]
                outputs.append(
                    RequestOutput(
                        seq.request_id,
                        [],
                        "",
                        finished=True,
                        finish_reason=FinishReason.ERROR,
                        usage=self._usage(seq),
                        message=f"{seq.error} (after {seq.num_output_tokens - 1} output tokens)",
                    )
                )
                continue
            detok = self.detokenizers[seq.request_id]
            if seq.finish_reason is FinishReason.STOP:
                text = detok.finish()  # the stop token's own text is never shown
            else:
                text = detok.add(token_id)
                if detok.stopped:
                    # Also when this token hit max_tokens: the stop string is why the text ends.
                    self.scheduler.finish(seq, FinishReason.STOP_STRING)
                    seq.finish_reason = FinishReason.STOP_STRING
                elif seq.is_finished:
                    text += detok.finish()
            out = RequestOutput(seq.request_id, [token_id], text, [logprobs] if logprobs else [])
            if seq.is_finished:
                out.finished, out.finish_reason, out.usage = True, seq.finish_reason, self._usage(seq)
                del self.detokenizers[seq.request_id]
            outputs.append(out)
        return outputs

    def _usage(self, seq: Sequence) -> Usage:
        ttft = (seq.first_token_time - seq.arrival_time) * 1000 if seq.first_token_time else 0.0
        return Usage(seq.num_prompt_tokens, seq.num_output_tokens, ttft, seq.num_cached_prompt_tokens)

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
                    res.hidden_states = out.hidden_states
        return [results[rid] for rid in ids]


def _inside(slots: torch.Tensor, num_prompt: int) -> bool:
    """Whether every (sorted) slot is a position of a prompt of `num_prompt` tokens."""
    return slots.numel() > 0 and 0 <= int(slots.min()) <= int(slots.max()) < num_prompt
