"""A Realtime session's input: its audio buffer (PCM16 at 24 kHz) and server VAD (what the detector
heard, as the session must tell the client: speech started, speech stopped with the turn's audio), and
its user items as Converse messages (the PCM as it came: the encoder takes PCM).

With encoding ahead (`TurnAhead`), the turn's audio ends `ms` into the silence that ended its speech,
and goes to the encoder as soon as the silence has lasted that long — before VAD calls the speech
stopped (`silence_duration_ms`), on exactly the bytes the turn will hold if the user stays silent; the
Converse turn then finds it encoded or under way (services/gateway/encode_cache.py). Speech that
resumes, a clear, a dropped turn or new VAD settings drop that clip's encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from omnistage.services.gateway.openai import realtime_events as rt
from omnistage.services.gateway.openai.vad import PAUSED, RESUMED, STARTED, STOPPED, TurnDetector, VadSettings
from omnistage.v1 import common_pb2, omni_pb2

AUDIO_CHUNK_BYTES = 64 * 1024  # PCM16 per Converse audio message


def converse_config(session_id: str, config: rt.SessionConfig) -> omni_pb2.ConverseRequest:
    """The Converse call's first message: the session's instructions, voice and output modalities."""
    modalities = [omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if config.audio_out else [])
    request = omni_pb2.GenerateRequest(
        request_id=session_id,
        system_prompt=config.instructions,
        voice=config.voice,
        output_modalities=modalities,
        sampling=common_pb2.SamplingParams(max_tokens=config.max_output_tokens),
    )
    return omni_pb2.ConverseRequest(config=request)


def turn_messages(item: rt.UserItem) -> list[omni_pb2.ConverseRequest]:
    """A user item as one Converse turn: its text, or its audio in chunks and end_of_turn."""
    if item.text:
        return [omni_pb2.ConverseRequest(text=item.text)]
    pcm = item.pcm16
    chunks = [
        omni_pb2.AudioChunk(pcm16=pcm[at : at + AUDIO_CHUNK_BYTES], sample_rate_hz=rt.RATE)
        for at in range(0, len(pcm), AUDIO_CHUNK_BYTES)
    ]
    return [*(omni_pb2.ConverseRequest(audio=c) for c in chunks), omni_pb2.ConverseRequest(end_of_turn=True)]


class AheadCache(Protocol):
    """The gateway's EncodeCache, as the session uses it."""

    def ahead(self, owner: str, pcm: bytes, rate: int) -> bytes | None: ...
    def drop(self, owner: str, key: bytes) -> None: ...
    def end(self, owner: str) -> None: ...


@dataclass(frozen=True)
class TurnAhead:
    """A session's encoding ahead: the cache, the session's id (its Converse call's request_id: the
    clips' owner), and the silence in ms after which a turn's audio goes (gateway.realtime_encode_ahead_ms)."""

    cache: AheadCache
    owner: str
    ms: int


@dataclass(frozen=True)
class Heard:
    """Speech began (at `sample` of the session's input), or ended (`pcm`: the turn, from its padding)."""

    started: bool
    item_id: str
    sample: int
    pcm: bytes = b""

    @property
    def ms(self) -> int:
        return self.sample * 1000 // rt.RATE


class InputBuffer:
    """The audio appended since the last turn (with server VAD: only the prefix padding before speech)."""

    def __init__(self, vad: VadSettings | None, ahead: TurnAhead | None = None) -> None:
        self.vad = vad
        self.ahead = ahead
        self.ahead_key: bytes | None = None  # the clip being encoded ahead for the speech heard now
        self.detector = self._detector(vad)
        self.vad_origin = 0  # sample of the session's input where the detector's clock began
        self.pcm = bytearray()
        self.start = 0  # sample of the session's input where `pcm` begins
        self.speech_start: int | None = None  # sample where the speech being heard began (server VAD)
        self.next_item = ""  # the id the speech being heard will have as an item
        self.dropping = False  # a turn too long was dropped: the rest of it is too, until its speech ends

    def __len__(self) -> int:
        return len(self.pcm)

    def _detector(self, vad: VadSettings | None) -> TurnDetector | None:
        return TurnDetector(vad, rt.RATE, self._tail_ms(vad)) if vad is not None else None

    def _tail_ms(self, vad: VadSettings | None) -> int:
        """The silence a turn keeps after its speech, where its encoding starts (0: none ahead)."""
        if self.ahead is None or vad is None:
            return 0
        return min(self.ahead.ms, vad.silence_duration_ms // 2)

    def set_vad(self, vad: VadSettings | None) -> None:
        """New VAD settings: a fresh detector whose clock starts now (no speech being heard)."""
        if vad != self.vad:
            self.vad = vad
            self.detector = self._detector(vad)
            self.vad_origin = self.start + len(self.pcm) // 2
            self.speech_start = None
            self._drop_ahead()

    def clear(self) -> None:
        self.start += len(self.pcm) // 2
        self.pcm.clear()
        self.speech_start = None
        self.dropping = False
        self._drop_ahead()
        if self.detector is not None:
            self.detector.reset()

    def drop_turn(self) -> None:
        """The turn being buffered is too long: its audio goes, and with server VAD so does the rest of
        the utterance until the detector hears it end (the detector keeps hearing it as one)."""
        self.start += len(self.pcm) // 2
        self.pcm.clear()
        self.speech_start = None
        self._drop_ahead()
        self.dropping = self.detector is not None and self.detector.speaking

    def take(self) -> bytes:
        """The buffer's audio, which leaves it (a commit)."""
        pcm = bytes(self.pcm)
        self.clear()
        return pcm

    def commit(self) -> bytes:
        """The client's commit: the buffer's audio (at least 100 ms), which leaves it."""
        if len(self.pcm) < rt.RATE // 10 * 2:
            raise rt.EventError(
                f"the input audio buffer holds {len(self.pcm) * 500 // rt.RATE} ms, at least 100 ms are needed",
                code="input_audio_buffer_commit_empty",
            )
        return self.take()

    def encode(self, pcm: bytes) -> None:
        """A user item's audio (committed, or created by the client): its encoding starts now, if it has
        not already (the item is the session's until it ends)."""
        if self.ahead is not None:
            self.ahead.cache.ahead(self.ahead.owner, pcm, rt.RATE)

    def close(self) -> None:
        """The session ended: its clips' encodings go."""
        if self.ahead is not None:
            self.ahead.cache.end(self.ahead.owner)

    async def append(self, pcm: bytes) -> list[Heard]:
        """Add `pcm`; with server VAD, what the detector heard in it, in order."""
        self.pcm += pcm
        if self.detector is None:
            return []
        heard = []
        for decision in await self.detector.feed(pcm):
            sample = self.vad_origin + decision.ms * rt.RATE // 1000
            if self.dropping:  # the dropped utterance: its end is no turn
                self.dropping = decision.kind != STOPPED
            elif decision.kind == STARTED:
                heard.append(self._started(sample))
            elif self.speech_start is None:
                continue
            elif decision.kind == PAUSED:
                pcm = bytes(self.pcm[: self._turn_end(decision.ms)])
                self.ahead_key = self.ahead.cache.ahead(self.ahead.owner, pcm, rt.RATE)
            elif decision.kind == RESUMED:
                self._drop_ahead()
            else:
                heard.append(Heard(False, self.next_item, sample, self._take_turn(decision.ms)))
        if self.dropping:
            self.start += len(self.pcm) // 2
            self.pcm.clear()
        elif self.speech_start is None:  # keep only the prefix padding before speech
            keep = self.vad.prefix_padding_ms * rt.RATE // 1000 * 2
            drop = max(0, len(self.pcm) - keep) // 2 * 2
            del self.pcm[:drop]
            self.start += drop // 2
        return heard

    def _started(self, sample: int) -> Heard:
        pad = self.vad.prefix_padding_ms * rt.RATE // 1000
        start = max(self.start, sample - pad)
        del self.pcm[: (start - self.start) * 2]
        self.start, self.speech_start = start, sample
        self.next_item = rt.new_id("item")
        return Heard(True, self.next_item, sample)

    def _turn_end(self, silence_ms: int) -> int:
        """Bytes of `pcm` that a turn whose silence began at `silence_ms` (detector clock) holds: its
        speech and the tail of silence where its encoding started."""
        end = self.vad_origin + (silence_ms + self._tail_ms(self.vad)) * rt.RATE // 1000
        return min(len(self.pcm), max(0, (end - self.start) * 2))

    def _take_turn(self, silence_ms: int) -> bytes:
        """The ended turn's audio, which leaves the buffer: without encoding ahead, all of it (through the
        silence that ended it); with, up to the tail its encoding started at (the same bytes), the rest
        staying as the next speech's padding."""
        if not self._tail_ms(self.vad):
            return self.take()
        n = self._turn_end(silence_ms)
        pcm = bytes(self.pcm[:n])
        del self.pcm[:n]
        self.start += n // 2
        self.speech_start, self.ahead_key = None, None
        return pcm

    def _drop_ahead(self) -> None:
        if self.ahead is not None and self.ahead_key is not None:
            self.ahead.cache.drop(self.ahead.owner, self.ahead_key)
        self.ahead_key = None
