"""The talker's streams are admitted like every stage's requests (ConcurrencyLimiter.admit): the Speak
call's deadline reaches the stream's settings, so a caller due before a slot frees gets
DEADLINE_EXCEEDED, not a wait past its own deadline."""

from __future__ import annotations

import asyncio
import math
import time

from omnistage.common.config import TalkerConfig
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.errors import DeadlineExceeded, Overloaded
from omnistage.services.talker.server import settings_of
from omnistage.v1 import talker_pb2


def test_the_calls_deadline_becomes_the_streams():
    config = talker_pb2.SpeakConfig(request_id="r1", voice="DB30")
    before = time.monotonic()
    timed = settings_of(config, TalkerConfig(), time_remaining=2.0)
    assert before + 2.0 <= timed.deadline <= time.monotonic() + 2.0
    assert settings_of(config, TalkerConfig()).deadline == math.inf  # no deadline: none


def test_a_stream_due_before_a_slot_frees_is_deadline_exceeded_and_one_with_time_is_overloaded():
    async def scenario() -> tuple[type, type]:
        streams = ConcurrencyLimiter("talker streams", 1)
        outcomes = []
        async with streams.admit(math.inf, 1.0, what="a stream slot"):
            for deadline in (time.monotonic() + 0.05, math.inf):
                try:
                    async with streams.admit(deadline, 0.2, what="a stream slot"):
                        outcomes.append(None)
                except (DeadlineExceeded, Overloaded) as exc:
                    outcomes.append(type(exc))
        return tuple(outcomes)

    assert asyncio.run(scenario()) == (DeadlineExceeded, Overloaded)
