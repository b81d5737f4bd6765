"""One admission per request: `Admission.admit(plan) → Ticket` decides at arrival whether the request
can be served in time, and the ticket hands out each stage's slot until the request's run releases it.

What a request is judged on, in one place: the gateway's bound of requests in flight, every gated stage
on its path (the encoder when it has media, the thinker, the image stage; each gate's waiting room and
its estimated wait plus service time against the deadline), the thinker's own cost (its expected tokens
at the measured pace of the batch it joins, pace.py / expected_cost.py), and whether its joining the
thinker's batch would make an admitted request late. Output stages that join the answer when they can
(the talker: its audio starts when a stream is free) never hold the text and never refuse a request:
their slot is taken by `join`, within a bounded wait, and "none in time" is the output's own status.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from omnistage.common.runtime.errors import Overloaded
from omnistage.services.gateway.admission import Coming, GateConfig, Slot, StageGate, check_path
from omnistage.services.gateway.expected_cost import AdmittedText, OutputLengths, TextRequest
from omnistage.services.gateway.pace import CHARS_PER_TOKEN, StepPace
from omnistage.services.gateway.plan import RequestPlan
from omnistage.services.gateway.validation import PlannedRequest, check_context
from omnistage.v1 import control_pb2


def answer_kind(request: PlannedRequest) -> tuple[int, ...]:
    """What answers are alike in length: those asked for the same output modalities."""
    return tuple(sorted(request.outputs))


class Admission:
    """The gates of the stages, what the thinker's pace and answers' lengths say, and the requests in flight."""

    def __init__(self, max_concurrent_requests: int, gates: dict[str, StageGate], service: str) -> None:
        self.max_concurrent_requests = max_concurrent_requests
        self.service = service
        self.in_flight = 0
        self.gates = gates
        self.gates.setdefault("thinker", StageGate("thinker", GateConfig(), service))
        # Gates of stages that join an answer when they can: never judged at arrival (join()).
        self.joined: set[str] = set()
        # The thinker's measured step time by batch size (pace.py), what answers of each kind produce
        # and the text requests admitted (expected_cost.py): a text request's own service time.
        self.pace = StepPace()
        self.lengths = OutputLengths()
        self.text = AdmittedText()
        self.default_max_tokens = 0  # the thinker's, from its Describe (0: unknown)
        self.max_model_len = 0  # the thinker's, from its Describe (0: unknown; then the thinker alone checks)

    @property
    def thinker_gate(self) -> StageGate:
        return self.gates["thinker"]

    def add_gate(self, stage: str, cfg: GateConfig, *, joins: bool = False) -> StageGate:
        """The gate of an output stage (sized from its replicas' Describe); `joins`: it never holds the
        text (its slot is taken by `Ticket.join`)."""
        gate = self.gates.setdefault(stage, StageGate(stage, cfg, self.service))
        if joins:
            self.joined.add(stage)
        return gate

    def thinker_described(self, limits: control_pb2.Limits) -> None:
        """The thinker's Describe: its batch and default max_tokens (the measure of a request), its
        max_model_len (what no request can pass, refused before admission) and its decode step timed
        at a short and the longest context (how a step grows with context: the pace's)."""
        self.thinker_gate.set_capacity(limits.max_running_requests)
        self.default_max_tokens = limits.default_max_tokens
        self.max_model_len = limits.max_model_len
        steps = sorted(limits.decode_step_times, key=lambda t: t.context_tokens)
        if len(steps) >= 2 and steps[0].sequences == steps[-1].sequences:
            short, long = steps[0], steps[-1]
            self.pace.observe_growth(
                short.sequences, (short.context_tokens, short.seconds), (long.context_tokens, long.seconds)
            )

    def set_capacity(self, stage: str, max_running: int, max_waiting: int | None = None) -> None:
        """What a stage runs at once (its Describe, read again after a restart)."""
        if stage in self.gates:
            self.gates[stage].set_capacity(max_running, max_waiting)

    def check_context(self, request: PlannedRequest) -> None:
        """Refuse what no thinker call can serve (max_tokens past the thinker's max_model_len): a request
        that can never be served is INVALID_ARGUMENT, not "not now". Checked once, where the plan is made."""
        check_context(request.sampling, request.least_prompt_tokens, self.max_model_len)

    def admit(self, plan: RequestPlan, remaining_s: float | None) -> Ticket:
        """Admit a Generate request now or refuse it (Overloaded: RESOURCE_EXHAUSTED, a retry hint)."""
        work = self.thinker_work(plan)
        self.check(plan.stages, remaining_s, work)
        prompt_tokens = plan.request.prompt_chars / CHARS_PER_TOKEN
        text = self.text.add(remaining_s, self.expected_tokens(plan), prompt_tokens) if plan.answers else None
        return Ticket(self, self.thinker_gate.expect(), text)

    def admit_conversation(self, remaining_s: float | None) -> Ticket:
        """A Converse call, admitted once at the thinker's gate for all its turns."""
        self.check(["thinker"], remaining_s)
        return Ticket(self, None, None)

    def check(
        self, stages: list[str], remaining_s: float | None, work_s: dict[str, float] | None = None
    ) -> None:
        """Refuse at arrival what cannot finish in time: the gateway's bound of requests, then the
        capacity of every gated stage on the path against the deadline (`work_s`: the request's own
        service time at a stage), then the thinker's batch join."""
        if self.in_flight >= self.max_concurrent_requests:
            raise Overloaded(
                f"gateway at its limit of {self.max_concurrent_requests} requests in flight "
                "(gateway.max_concurrent_requests)",
                retry_after_ms=200,
                reason="gateway_full",
            )
        gates = [self.gates[s] for s in stages if s in self.gates and s not in self.joined]
        check_path(gates, remaining_s, work_s)
        if work_s and "thinker" in work_s:
            self._check_join()

    def expected_tokens(self, plan: RequestPlan) -> int:
        """Tokens the request's text answer is priced at: what finished answers of its kind produced,
        within its max_tokens (or the thinker's default, clamped to its context); 0: unknown."""
        if not plan.answers:
            return 1  # hidden-state mode only: one prefill
        request = plan.request
        cap = request.sampling.max_tokens or self.default_max_tokens
        if self.max_model_len:
            cap = min(cap, self.max_model_len - request.least_prompt_tokens)
        return self.lengths.expected(answer_kind(request), cap) if cap > 0 else 0

    def thinker_work(self, plan: RequestPlan) -> dict[str, float]:
        """The thinker's time for the request's text answer: its expected tokens and prompt at the
        measured step time of the batch it joins; {} while unmeasured."""
        tokens = self.expected_tokens(plan)
        work = (
            self.pace.work_s(tokens, plan.request.prompt_chars, self._batch(capped=True)) if tokens else None
        )
        return {} if work is None else {"thinker": work}

    def _batch(self, *, capped: bool) -> int:
        """The thinker's batch with one more request (`capped`: at most what it runs at once)."""
        gate = self.thinker_gate
        batch = gate.running + gate.waiting + gate.coming + 1
        return min(batch, gate.cfg.max_running) if capped and gate.cfg.max_running else batch

    def _check_join(self) -> None:
        """Refuse now (Overloaded) a request whose joining the thinker's batch would make an admitted
        one late that finishes in time at today's batch: each step slows as the batch grows. A request
        that has to wait for a slot does not slow the batch (the wait estimate judged it)."""
        gate, batch = self.thinker_gate, self._batch(capped=False)
        if batch < 2 or (gate.cfg.max_running and batch > gate.cfg.max_running):
            return
        late = self.text.slowed_late(self.pace.step_s, batch - 1)
        if late is not None:
            request, done_in_s, step_now, step_joined = late
            raise gate.refuse(
                f"joining its batch of {batch - 1} would slow an admitted request past its deadline "
                f"({request.left()} tokens left at {step_joined:.3f}s a step instead of {step_now:.3f}s)",
                done_in_s,
            )


class Ticket:
    """An admitted request (or Converse call): in flight, on its way to the thinker's gate, one of the
    text requests whose deadlines later arrivals keep; it hands out the slots of the stages on its path
    and is released (once) by the run that holds it."""

    def __init__(self, admission: Admission, coming: Coming | None, text: TextRequest | None) -> None:
        self.admission = admission
        self.coming = coming
        self.text = text
        self.released = False
        admission.in_flight += 1

    @contextlib.asynccontextmanager
    async def slot(self, stage: str, remaining_s: float | None) -> AsyncIterator[Slot | None]:
        """A slot of `stage`'s gate for the block, waited for in FIFO order within the deadline (a stage
        without a gate: none)."""
        gate = self.admission.gates.get(stage)
        if stage == "thinker" and self.coming is not None:
            self.coming.arrived()  # no longer counted as on its way: it takes or waits for a slot now
        if gate is None:
            yield None
            return
        async with gate.slot(remaining_s) as held:
            yield held

    async def join(self, stage: str, wait_s: float, *, first: bool = False) -> Slot:
        """A slot of a stage that joins the answer when it can (the talker's stream): at once when one is
        free, else waited for in FIFO order at most `wait_s`. Overloaded (its estimated wait as the retry
        hint) when the waiting room is full or no slot can free in time; DeadlineExceeded past the wait.
        `first`: ahead of the waiters (a spoken answer whose talker replica was lost under its speech).
        The caller releases it."""
        gate = self.admission.gates[stage]
        wait = gate.estimated_wait_s(ahead=0, coming=False) if first else gate.check_room(coming=False)
        if wait > wait_s:
            raise gate.refuse(
                f"all {gate.cfg.max_running} slots are held ({gate.waiting} waiting); none is expected to "
                f"free within {wait_s:.1f}s",
                wait,
            )
        return await gate.take(wait_s, first=first)

    def tokens(self, count: int) -> None:
        """The request's text answer streamed `count` more tokens."""
        if self.text is not None:
            self.text.produced += count

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self.admission.in_flight -= 1
        if self.coming is not None:
            self.coming.arrived()
        if self.text is not None:
            self.admission.text.remove(self.text)
