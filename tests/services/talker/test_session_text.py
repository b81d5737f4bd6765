"""A Speak session's text reader: the first segment's time limit cuts between two messages, so the
first audio never waits for text the thinker has not decoded yet."""

from __future__ import annotations

import asyncio

from omnistage.common.config import TalkerConfig
from omnistage.services.talker import request_flow as session_mod
from omnistage.services.talker.request_flow import SpeakSession, TextInput


async def _segments_of(session: SpeakSession, release: asyncio.Event) -> tuple[str, list[str]]:
    first_text, _ = await asyncio.wait_for(session._segments.get(), 30)
    release.set()  # the rest of the text comes only once the first segment was cut
    rest = []
    while (item := await asyncio.wait_for(session._segments.get(), 30)) is not session_mod._END:
        rest.append(item[0])
    return first_text, rest


def test_the_first_segment_is_cut_while_the_next_text_is_still_coming(voices):
    cfg = TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0.05)
    session = SpeakSession(engine=None, voices=voices, cfg=cfg, pool=None)
    release = asyncio.Event()

    async def inputs():
        yield TextInput("Hello there my friend how")
        await release.wait()  # the thinker is slow: no more text until the first segment was cut
        yield TextInput(" are you", end_of_text=True)

    async def scenario():
        reader = asyncio.create_task(session._read(inputs()))
        out = await _segments_of(session, release)
        await reader
        return out

    first, rest = asyncio.run(scenario())
    assert first == "Hello there my friend"  # 'how' may still grow: it waits for the next segment
    assert rest == ["how are you"]


def test_without_a_time_limit_the_reader_waits_for_the_text(voices):
    cfg = TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0)
    session = SpeakSession(engine=None, voices=voices, cfg=cfg, pool=None)

    async def inputs():
        yield TextInput("Hello there my friend how")
        yield TextInput(" are you", end_of_text=True)

    async def scenario():
        await session._read(inputs())
        items = []
        while (item := session._segments.get_nowait()) is not session_mod._END:
            items.append(item[0])
        return items

    assert asyncio.run(scenario()) == ["Hello there my friend how are you"]
