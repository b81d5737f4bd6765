"""A Speak session's text reader: the first segment's time limit cuts between two messages, so the
first audio never waits for text the thinker has not decoded yet; each segment says where it ends in the
stream's text (SegmentDone.text_end), and a stream with nothing to speak is refused with its reason."""

from __future__ import annotations

import asyncio

import pytest
from omnistage.common.config import TalkerConfig
from omnistage.common.runtime.errors import ERROR_REASON_KEY, NOTHING_TO_SPEAK, InvalidRequest, status_for
from omnistage.services.talker import request_flow as session_mod
from omnistage.services.talker.request_flow import SegmentSpoken, SpeakSession, StreamSettings, TextInput
from omnistage.services.talker.server import to_proto


async def _segments_of(session: SpeakSession, release: asyncio.Event) -> tuple[str, list[str]]:
    first_text, _ = await asyncio.wait_for(session._segments.get(), 30)
    release.set()  # the rest of the text comes only once the first segment was cut
    rest = []
    while (item := await asyncio.wait_for(session._segments.get(), 30)) is not session_mod._END:
        rest.append(item[0])
    return first_text, rest


async def _all_segments(session: SpeakSession, inputs) -> list[str]:
    """The segments the session's reader makes of all of `inputs`."""
    await session._read(inputs)
    items = []
    while (item := session._segments.get_nowait()) is not session_mod._END:
        items.append(item[0])
    return items


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

    assert asyncio.run(_all_segments(session, inputs())) == ["Hello there my friend how are you"]


def test_segments_end_where_their_text_ends_across_the_streams_messages(voices):
    cfg = TalkerConfig(first_segment_max_pieces=0, first_segment_max_wait_s=0)
    session = SpeakSession(engine=None, voices=voices, cfg=cfg, pool=None)
    messages = ["Hello there, my", " friend. How are", " you today?", " Fine."]

    async def inputs():
        for i, text in enumerate(messages):
            yield TextInput(text, end_of_text=i == len(messages) - 1)

    segments = asyncio.run(_all_segments(session, inputs()))
    text = "".join(messages)
    assert segments == ["Hello there, my friend.", "How are you today?", "Fine."]
    assert [s.text_end for s in segments] == [text.index(".") + 1, text.index("?") + 1, len(text)]


def test_a_stream_with_nothing_to_speak_is_refused_with_its_reason(voices):
    """The reason lets a caller act on the kind (a stream moved to another talker for an answer's rest
    that has nothing to speak is complete), never on the message's words."""
    session = SpeakSession(engine=None, voices=voices, cfg=TalkerConfig(), pool=None)

    async def inputs():
        yield TextInput(" ... :) ", end_of_text=True)

    async def scenario():
        return [e async for e in session.run(StreamSettings("r1"), inputs())]

    with pytest.raises(InvalidRequest, match="nothing to speak") as info:
        asyncio.run(scenario())
    assert info.value.reason == NOTHING_TO_SPEAK
    assert status_for(info.value)[2] == ((ERROR_REASON_KEY, NOTHING_TO_SPEAK),)  # its trailing metadata


def test_segment_done_says_where_the_segment_ends_in_the_streams_text():
    event = SegmentSpoken(3, "Fine.", 441, 2, True, text_end=57)
    assert to_proto(event).segment_done.text_end == 57
