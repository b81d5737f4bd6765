"""Encoding a Realtime turn ahead of VAD's speech end (Silero on a speech-like signal, a cache that
records what it is asked): the clip goes to the encoder once the silence has lasted the tail, on
exactly the bytes the turn then holds; speech that resumes drops it; the session's end ends its
clips; and a session sends the encode before it tells the client `speech_stopped`."""

from __future__ import annotations

import asyncio
import base64

from omnistage.services.gateway.openai.realtime import RealtimeEndpoint
from omnistage.services.gateway.openai.realtime_input import InputBuffer, TurnAhead
from omnistage.services.gateway.openai.realtime_limits import RealtimeOptions
from omnistage.services.gateway.openai.vad import PAUSED, RESUMED, STARTED, STOPPED, TurnDetector, VadSettings

from tests.services.gateway.realtime_audio import utterance
from tests.services.gateway.test_realtime_session import KEYS, FakeStub, Socket

TWO_WORDS = utterance(0.6, 0.3, 0.25) + utterance(0.6, 0.0, 1.2)  # a 0.55 s pause between the words


class RecordingCache:
    """The encode cache as a session sees it: what it was asked, in order (and, with `sent`, how many
    socket messages had gone out by then)."""

    def __init__(self, sent: list | None = None) -> None:
        self.log: list[tuple] = []
        self.sent = sent

    def ahead(self, owner: str, pcm: bytes, rate: int) -> bytes:
        self.log.append(("ahead", owner, pcm, rate, len(self.sent) if self.sent is not None else -1))
        return f"key{len(self.log)}".encode()

    def drop(self, owner: str, key: bytes) -> None:
        self.log.append(("drop", owner, key))

    def end(self, owner: str) -> None:
        self.log.append(("end", owner))


def _feed(buffer: InputBuffer, pcm: bytes, chunk: int = 4800):
    async def go():
        heard = []
        for at in range(0, len(pcm), chunk):
            heard += await buffer.append(pcm[at : at + chunk])
        return heard

    return asyncio.run(go())


def test_the_detector_tells_a_pause_and_speech_that_resumes_after_it():
    async def go():
        detector = TurnDetector(VadSettings(silence_duration_ms=800), 24000, pause_ms=200)
        events = []
        for at in range(0, len(TWO_WORDS), 4800):
            events += await detector.feed(TWO_WORDS[at : at + 4800])
        return events

    events = asyncio.run(go())
    assert [e.kind for e in events] == [STARTED, PAUSED, RESUMED, PAUSED, STOPPED]
    paused, stopped = events[3], events[4]
    assert paused.ms == stopped.ms  # both say where the last silence began


def test_the_turn_is_the_clip_encoded_at_its_pause_and_a_resumed_pause_is_dropped():
    cache = RecordingCache()
    vad = VadSettings(silence_duration_ms=800, prefix_padding_ms=0)  # the turn begins where speech does
    buffer = InputBuffer(vad, TurnAhead(cache, "sess_1", 200))
    heard = _feed(buffer, TWO_WORDS)
    buffer.close()
    assert [h.started for h in heard] == [True, False]
    kinds = [entry[0] for entry in cache.log]
    assert kinds == ["ahead", "drop", "ahead", "end"]
    (_, _, first, rate, _), (_, _, dropped), (_, _, second, _, _) = cache.log[:3]
    assert rate == 24000 and dropped == b"key1"  # the first pause's clip: the user spoke on
    assert heard[1].pcm == second and second.startswith(first) and len(second) > len(first)
    # The turn ends 200 ms into the silence that ended it (VAD waited 800 ms to call it over).
    assert len(second) == (heard[1].ms + 200 - heard[0].ms) * 48  # 48 bytes a ms at 24 kHz PCM16
    assert cache.log[3] == ("end", "sess_1")


def test_without_encoding_ahead_the_turn_runs_through_its_silence():
    buffer = InputBuffer(VadSettings(silence_duration_ms=800))
    heard = _feed(buffer, TWO_WORDS)
    assert [h.started for h in heard] == [True, False]
    assert len(heard[1].pcm) >= (heard[1].ms - heard[0].ms + 300 + 800 - 64) * 48


def test_a_clear_drops_the_clip_encoded_ahead():
    cache = RecordingCache()
    buffer = InputBuffer(VadSettings(silence_duration_ms=800), TurnAhead(cache, "sess_1", 200))
    first_word = utterance(0.6, 0.3, 0.4)  # a pause, no end yet
    assert [h.started for h in _feed(buffer, first_word)] == [True]
    buffer.clear()
    assert [entry[0] for entry in cache.log] == ["ahead", "drop"]


def test_a_session_encodes_its_turn_before_it_says_speech_stopped_and_ends_its_clips_with_it():
    async def scenario():
        cache = RecordingCache()
        app = RealtimeEndpoint(FakeStub(), RealtimeOptions(), "m", KEYS.refusal, kept=cache)
        s = Socket(app)
        cache.sent = s.sent
        s.send({"type": "session.update", "session": {"output_modalities": ["text"]}})
        said = utterance(0.8, 0.5, 0.8)
        for at in range(0, len(said), 4800):
            s.send(
                {
                    "type": "input_audio_buffer.append",
                    "audio": base64.b64encode(said[at : at + 4800]).decode(),
                }
            )
        await s.until("response.done")
        session_id = s.events()[0]["session"]["id"]
        s.close()
        await s.task
        return app.stub.calls[0], cache.log, s, session_id

    call, log, s, session_id = asyncio.run(asyncio.wait_for(scenario(), 60))
    aheads = [entry for entry in log if entry[0] == "ahead"]
    stopped_at = next(
        i for i, m in enumerate(s.sent) if m["type"] == "websocket.send" and "speech_stopped" in m["text"]
    )
    assert aheads and aheads[0][1] == session_id and aheads[0][4] <= stopped_at  # before the client heard
    turn_pcm = b"".join(m.audio.pcm16 for m in call.written if m.HasField("audio"))
    assert turn_pcm == aheads[0][2]  # the Converse turn holds exactly the clip encoded ahead
    assert all(entry[2] == turn_pcm for entry in aheads)  # the committed item asked for the same clip
    assert log[-1] == ("end", session_id)
