"""A Realtime session's input: its audio buffer (PCM16 at 24 kHz) and server VAD (what the detector
heard, as the session must tell the client: speech started, speech stopped with the turn's audio), and
its user items as Converse messages (the PCM as it came: the encoder takes PCM)."""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.services.gateway.openai import realtime_events as rt
from omnistage.services.gateway.openai.vad import TurnDetector, VadSettings
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

    def __init__(self, vad: VadSettings | None) -> None:
        self.vad = vad
        self.detector: TurnDetector | None = TurnDetector(vad, rt.RATE) if vad is not None else None
        self.vad_origin = 0  # sample of the session's input where the detector's clock began
        self.pcm = bytearray()
        self.start = 0  # sample of the session's input where `pcm` begins
        self.speech_start: int | None = None  # sample where the speech being heard began (server VAD)
        self.next_item = ""  # the id the speech being heard will have as an item
        self.dropping = False  # a turn too long was dropped: the rest of it is too, until its speech ends

    def __len__(self) -> int:
        return len(self.pcm)

    def set_vad(self, vad: VadSettings | None) -> None:
        """New VAD settings: a fresh detector whose clock starts now (no speech being heard)."""
        if vad != self.vad:
            self.vad = vad
            self.detector = TurnDetector(vad, rt.RATE) if vad is not None else None
            self.vad_origin = self.start + len(self.pcm) // 2
            self.speech_start = None

    def clear(self) -> None:
        self.start += len(self.pcm) // 2
        self.pcm.clear()
        self.speech_start = None
        self.dropping = False
        if self.detector is not None:
            self.detector.reset()

    def drop_turn(self) -> None:
        """The turn being buffered is too long: its audio goes, and with server VAD so does the rest of
        the utterance until the detector hears it end (the detector keeps hearing it as one)."""
        self.start += len(self.pcm) // 2
        self.pcm.clear()
        self.speech_start = None
        self.dropping = self.detector is not None and self.detector.speaking

    def take(self) -> bytes:
        """The buffer's audio, which leaves it (a commit)."""
        pcm = bytes(self.pcm)
        self.clear()
        return pcm

    async def append(self, pcm: bytes) -> list[Heard]:
        """Add `pcm`; with server VAD, what the detector heard in it, in order."""
        self.pcm += pcm
        if self.detector is None:
            return []
        heard = []
        for decision in await self.detector.feed(pcm):
            sample = self.vad_origin + decision.ms * rt.RATE // 1000
            if self.dropping:  # the dropped utterance: its end is no turn
                self.dropping = decision.started
            elif decision.started:
                heard.append(self._started(sample))
            elif self.speech_start is not None:
                heard.append(Heard(False, self.next_item, sample, self.take()))
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
