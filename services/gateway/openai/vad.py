"""Server voice activity detection for the Realtime endpoint: Silero VAD (the ONNX model the
`silero-vad` package ships, run with onnxruntime) behind the protocol's `server_vad` knobs.

One ONNX session per process (onnxruntime's `run` is thread-safe), one `TurnDetector` per Realtime
session holding that session's recurrent state. Inference runs in a small thread pool of its own, never
on the event loop (`TurnDetector.feed` is awaited by the session's reader).
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from omnistage.services.gateway.openai.pcm import Pcm16Resampler

VAD_RATE = 16000
FRAME = 512  # samples at 16 kHz per inference (32 ms): the model's window
CONTEXT = 64  # samples of the previous frame the model sees again
FRAME_MS = FRAME * 1000 // VAD_RATE
# Speech ends when the probability falls this far below the threshold (Silero's own hysteresis).
HYSTERESIS = 0.15
_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="realtime-vad")
_lock = threading.Lock()
_session = None


def model_path() -> Path:
    """The ONNX model inside the installed `silero-vad` package (found without importing it: its
    `__init__` imports torch, which the gateway does not need)."""
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the 'silero-vad' package is not installed (a dependency of omnistage)")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


def _onnx():
    global _session
    with _lock:
        if _session is None:
            import onnxruntime as ort

            opts = ort.SessionOptions()
            opts.inter_op_num_threads = 1
            opts.intra_op_num_threads = 1
            _session = ort.InferenceSession(
                str(model_path()), sess_options=opts, providers=["CPUExecutionProvider"]
            )
        return _session


@dataclass(frozen=True)
class VadSettings:
    """`turn_detection` of type `server_vad` (the protocol's defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    create_response: bool = True
    interrupt_response: bool = True


STARTED, PAUSED, RESUMED, STOPPED = "started", "paused", "resumed", "stopped"


@dataclass(frozen=True)
class VadEvent:
    """Speech began, paused (its silence lasted the detector's `pause_ms`), resumed after such a pause, or
    ended (`kind`), at `ms` of the session's input audio: where a pause or the end's silence began."""

    kind: str
    ms: int

    @property
    def started(self) -> bool:
        return self.kind == STARTED


class TurnDetector:
    """PCM16 at `rate` in; speech start and end out. Speech starts at the first frame at or above the
    threshold and ends once the probability stayed below threshold - 0.15 for silence_duration_ms
    (its end is where that silence began). With `pause_ms`, a silence that lasted that long is told
    first (`paused`: the speech may be over), and so is speech that comes back after it (`resumed`)."""

    def __init__(self, settings: VadSettings, rate: int, pause_ms: int = 0) -> None:
        self.settings = settings
        self.pause_ms = pause_ms
        self._resampler = Pcm16Resampler(rate, VAD_RATE)
        self._pending = np.zeros(0, np.float32)
        self._state = np.zeros((2, 1, 128), np.float32)
        self._context = np.zeros((1, CONTEXT), np.float32)
        self._frames = 0  # frames seen: the time of the next one is frames * FRAME_MS
        self.speaking = False
        self._silence_from: int | None = None  # frame where the current silence began
        self._paused = False  # the current silence was told as a pause

    async def feed(self, pcm16: bytes) -> list[VadEvent]:
        """The decisions `pcm16` brings (inference off the event loop)."""
        return await asyncio.get_running_loop().run_in_executor(_pool, self._feed, pcm16)

    def probabilities(self, pcm16: bytes) -> list[float]:
        """Speech probability of each complete frame `pcm16` brings (with what was left before)."""
        x = np.frombuffer(self._resampler.convert(pcm16), dtype="<i2").astype(np.float32) / 32768.0
        self._pending = np.concatenate([self._pending, x])
        out = []
        session = _onnx()
        sr = np.array(VAD_RATE, np.int64)
        while self._pending.size >= FRAME:
            frame, self._pending = self._pending[:FRAME], self._pending[FRAME:]
            window = np.concatenate([self._context, frame[None, :]], axis=1)
            prob, self._state = session.run(None, {"input": window, "state": self._state, "sr": sr})
            self._context = window[:, -CONTEXT:]
            out.append(float(prob[0, 0]))
        return out

    def _feed(self, pcm16: bytes) -> list[VadEvent]:
        s, events = self.settings, []
        for prob in self.probabilities(pcm16):
            at = self._frames
            self._frames += 1
            if prob >= s.threshold:
                self._silence_from = None
                if not self.speaking or self._paused:
                    events.append(VadEvent(RESUMED if self.speaking else STARTED, at * FRAME_MS))
                    self.speaking, self._paused = True, False
            elif self.speaking and prob < s.threshold - HYSTERESIS:
                if self._silence_from is None:
                    self._silence_from = at
                since_ms = self._silence_from * FRAME_MS
                silent_ms = self._frames * FRAME_MS - since_ms
                if self.pause_ms and not self._paused and silent_ms >= self.pause_ms:
                    self._paused = True
                    events.append(VadEvent(PAUSED, since_ms))
                if silent_ms >= s.silence_duration_ms:
                    self.reset()
                    events.append(VadEvent(STOPPED, since_ms))
        return events

    def reset(self) -> None:
        """Forget the current speech (the buffer was cleared or committed by the client)."""
        self.speaking, self._silence_from, self._paused = False, None, False


def warm_up() -> None:
    """Load the model now (a worker thread; at start-up), so the first session does not wait for it."""
    _onnx()
