"""One Talker.Speak call of a spoken answer, on one talker replica: the config, then the answer's text from
where this call takes it up (all of it for the first call; from the segment not spoken yet for a call
that goes on after its replica was lost), then the text as the thinker writes it, `end_of_text` last.
TalkerStream (talker_stream.py) opens one call at a time and reads it."""

from __future__ import annotations

import asyncio

import grpc
from omnistage.services.gateway.stages import TalkerClient
from omnistage.v1 import talker_pb2

_END_OF_TEXT, _STOP = object(), object()  # the requests' ends: with end_of_text, or without (stopped)


class _Requests:
    """What the Speak call sends: the config, then (once the talker accepted it) the text as it came,
    end_of_text last. Its only reader is grpc's task for the call; the call's owner ends it on every path
    (`_STOP`), so that task ends whether the call is live or over (a class, not an async generator: grpc
    leaves an iterator it stops reading where it is, and an async generator left so is finalized later)."""

    def __init__(self, config: talker_pb2.SpeakConfig, verdict: asyncio.Event) -> None:
        self.config: talker_pb2.SpeakConfig | None = config
        self.verdict = verdict
        self.texts: asyncio.Queue = asyncio.Queue()  # bounded by the talker's max_text_chars
        self.over = False

    def __aiter__(self) -> _Requests:
        return self

    async def __anext__(self) -> talker_pb2.SpeakRequest:
        if self.config is not None:
            config, self.config = self.config, None
            return talker_pb2.SpeakRequest(config=config)
        # No text before the talker's verdict on the config: a write racing its refusal makes grpc
        # report INTERNAL "Internal error from Core" instead of the talker's status.
        await self.verdict.wait()
        if self.over:
            raise StopAsyncIteration
        items = [await self.texts.get()]
        while not self.texts.empty():
            items.append(self.texts.get_nowait())
        self.over = _STOP in items or _END_OF_TEXT in items
        if _STOP in items:
            raise StopAsyncIteration
        text = "".join(i for i in items if isinstance(i, str))
        return talker_pb2.SpeakRequest(text=text, end_of_text=_END_OF_TEXT in items)


class SpeakCall:
    """An open Speak call on `talker` that speaks the answer's text from character `start` on (`text`:
    what of it was written already; `text_over`: all of it). Once its text is over, the talker has
    `idle_timeout_s` to answer each read (TimeoutError past it)."""

    def __init__(
        self,
        talker: TalkerClient,
        config: talker_pb2.SpeakConfig,
        start: int,
        text: str,
        text_over: bool,
        idle_timeout_s: float,
        timeout_s: float | None,
    ) -> None:
        self.talker = talker
        self.start = start
        self.idle_timeout_s = idle_timeout_s
        self.verdict = asyncio.Event()  # the talker started the call, or the call is over
        self.requests = _Requests(config, self.verdict)
        self.stopped = False  # the gateway cancelled it (`cancel`)
        self.text_over = False
        self._silence: asyncio.Timeout | None = None  # armed while a read waits, once the text is over
        if text:
            self.send(text)
        if text_over:
            self.end_text()
        self.call: grpc.aio.StreamStreamCall = talker.speak(self.requests, timeout_s)

    def send(self, text: str) -> None:
        self.requests.texts.put_nowait(text)

    def end_text(self) -> None:
        """No more text: `end_of_text` goes out, and the talker's silence is timed from now on."""
        if not self.text_over:
            self.text_over = True
            self.requests.texts.put_nowait(_END_OF_TEXT)
            self._arm_silence()

    async def read(self) -> talker_pb2.SpeakResponse | object:
        """The talker's next event, or grpc.aio.EOF at the call's end (its error raised)."""
        async with asyncio.timeout(None) as self._silence:
            self._arm_silence()
            try:
                return await self.call.read()
            finally:
                self._silence = None

    def cancel(self) -> None:
        """Stop the call (the answer was aborted): its reader sees a cancelled call it asked for."""
        if not self.call.done():
            self.stopped = True
            self.call.cancel()

    def close(self) -> None:
        """The call is over for its owner: grpc's task reading the requests ends too."""
        self.verdict.set()
        self.requests.texts.put_nowait(_STOP)

    def _arm_silence(self) -> None:
        if self.text_over and self._silence is not None and self._silence.when() is None:
            loop = asyncio.get_running_loop()
            self._silence.reschedule(loop.time() + self.idle_timeout_s)
