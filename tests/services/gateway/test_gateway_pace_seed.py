"""The start-up stress that seeds the thinker's pace times each request from its call to its last token:
a gateway that reads every delta at once (a loaded host) must not take the steps for instant."""

from __future__ import annotations

import asyncio

from omnistage.services.gateway.pace import StepPace
from omnistage.services.gateway.startup import PACE_TOKENS as _PACE_TOKENS
from omnistage.services.gateway.startup import seed_pace as _seed_pace
from omnistage.v1 import thinker_pb2

STEP_S = 0.01


class BunchedThinker:
    """Its steps take STEP_S each, but every delta reaches the gateway at once, after the last step."""

    def __init__(self) -> None:
        self.batches: list[int] = []
        self.running = 0

    async def generate(self, name, prompt, sampling, timeout_s):
        self.running += 1
        self.batches.append(self.running)
        await asyncio.sleep(STEP_S * sampling.max_tokens)
        self.running -= 1
        yield thinker_pb2.ThinkerEvent(started=thinker_pb2.Started())
        for _ in range(sampling.max_tokens):
            yield thinker_pb2.ThinkerEvent(delta=thinker_pb2.TokenDelta(token_ids=[7]))


def test_bunched_deltas_still_give_the_real_step_time_at_each_batch():
    pace = StepPace()
    thinker = BunchedThinker()
    asyncio.run(_seed_pace(thinker, pace, 8))
    assert max(thinker.batches) == 8  # alone, a quarter, half and the full batch at once
    for batch in (1, 2, 4, 8):
        # at least the steps' time (the sleep), never the ~0 the deltas' arrival times would say
        assert pace.step_s(batch) is not None and pace.step_s(batch) >= STEP_S
    assert _PACE_TOKENS >= 8
