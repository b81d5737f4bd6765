"""Python client of the Omni gRPC API: `OmniClient` (sync) and `AsyncOmniClient` (asyncio)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Generic, TypeVar

import grpc
from omnistage.common.runtime import auth
from omnistage.common.wav import wav_bytes
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

MediaLike = bytes | str | Path
StreamT = TypeVar("StreamT")

_MODALITY = {
    "text": omni_pb2.MODALITY_TEXT,
    "audio": omni_pb2.MODALITY_AUDIO,
    "image": omni_pb2.MODALITY_IMAGE,
}


def media(value: MediaLike, mime_type: str = "") -> omni_pb2.Media:
    """Media of raw bytes or a local file (read here and sent inline)."""
    data = value if isinstance(value, bytes) else Path(value).read_bytes()
    return omni_pb2.Media(data=data, mime_type=mime_type)


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[omni_pb2.ChatMessage] = (),
    images: Iterable[MediaLike] = (),
    audios: Iterable[MediaLike] = (),
    videos: Iterable[MediaLike] = (),
    modalities: Iterable[str] = ("text",),
    voice: str = "",
    image: omni_pb2.ImageOptions | None = None,
    system_prompt: str = "",
    request_id: str = "",
    max_tokens: int = 0,
    temperature: float = 0.0,
    top_p: float = 0.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
) -> omni_pb2.GenerateRequest:
    """A GenerateRequest: `messages` (earlier turns) then one user message of the media and `prompt`."""
    parts = [omni_pb2.ContentPart(image=media(m)) for m in images]
    parts += [omni_pb2.ContentPart(audio=media(m)) for m in audios]
    parts += [omni_pb2.ContentPart(video=media(m)) for m in videos]
    if prompt:
        parts.append(omni_pb2.ContentPart(text=prompt))
    msgs = list(messages)
    if parts:
        msgs.append(omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=parts))
    unknown = [m for m in modalities if m not in _MODALITY]
    if unknown:
        raise ValueError(f"modalities: unknown {unknown} (text, audio, image)")
    sampling = common_pb2.SamplingParams(
        temperature=temperature, top_p=top_p, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos
    )
    if seed is not None:
        sampling.seed = seed
    request = omni_pb2.GenerateRequest(
        request_id=request_id,
        messages=msgs,
        sampling=sampling,
        voice=voice,
        system_prompt=system_prompt,
        output_modalities=[_MODALITY[m] for m in modalities],
    )
    if image is not None:
        request.image.CopyFrom(image)
    return request


@dataclass
class Result:
    """A whole answer: text, speech (PCM16), images (PNG) and the Finish."""

    text: str = ""
    pcm16: bytes = b""
    sample_rate_hz: int = 0
    images: list[omni_pb2.ImageResult] = field(default_factory=list)
    finish: omni_pb2.Finish | None = None
    request_id: str = ""
    # One per generated token when SamplingParams.logprobs > 0, in order.
    logprobs: list[common_pb2.TokenLogprobs] = field(default_factory=list)
    # The tools the answer called (GenerateRequest.tools), in order.
    tool_calls: list[omni_pb2.ToolCall] = field(default_factory=list)

    def add(self, event: omni_pb2.GenerateEvent) -> None:
        self.request_id = self.request_id or event.request_id
        kind = event.WhichOneof("event")
        if kind == "text":
            self.text += event.text.text
            self.logprobs.extend(event.text.logprobs)
        elif kind == "audio":
            self.pcm16 += event.audio.pcm16
            self.sample_rate_hz = event.audio.sample_rate_hz or self.sample_rate_hz
        elif kind == "image":
            self.images.append(event.image)
        elif kind == "tool_call":
            self.tool_calls.append(event.tool_call)
        elif kind == "finish":
            self.finish = event.finish

    def wav(self) -> bytes:
        """The speech as a WAV file (empty audio when none was spoken)."""
        rate = self.sample_rate_hz or (self.finish.audio.sample_rate_hz if self.finish else 0) or 44100
        return wav_bytes(self.pcm16, rate)

    def png(self, index: int = 0) -> bytes:
        """The `index`-th image's PNG bytes (IndexError when there is none)."""
        return self.images[index].png

    @property
    def ok(self) -> bool:
        return self.finish is not None and self.finish.reason in (
            common_pb2.FINISH_REASON_STOP,
            common_pb2.FINISH_REASON_STOP_STRING,
            common_pb2.FINISH_REASON_TOOL_CALLS,
            common_pb2.FINISH_REASON_LENGTH,
        )


def _channel(
    api: Any, address: str, credentials: grpc.ChannelCredentials | None, tls: bool, max_message_bytes: int
) -> Any:
    """A channel of `api` (grpc or grpc.aio): TLS with `credentials` (system roots when only `tls`)."""
    args = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if credentials is None and tls:
        credentials = grpc.ssl_channel_credentials()
    if credentials is not None:
        return api.secure_channel(address, credentials, args)
    return api.insecure_channel(address, args)


def tls_credentials(ca_file: str = "", cert_file: str = "", key_file: str = "") -> grpc.ChannelCredentials:
    """TLS channel credentials: the CA to trust (system roots when empty) and a client pair (mutual TLS)."""
    return auth.tls_credentials(ca_file, cert_file, key_file)


class EventStream:
    """The events of one Generate call (iterate once); `cancel()` or leaving early ends the request."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[omni_pb2.GenerateEvent]:
        try:
            yield from self._call
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    def collect(self, on_event: Callable[[omni_pb2.GenerateEvent], None] | None = None) -> Result:
        result = Result()
        for event in self:
            if on_event is not None:
                on_event(event)
            result.add(event)
        return result

    def __enter__(self) -> EventStream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncEventStream:
    """The events of one Generate call on asyncio; `cancel()` or leaving early ends the request."""

    def __init__(self, call) -> None:
        self._call = call

    async def __aiter__(self) -> AsyncIterator[omni_pb2.GenerateEvent]:
        try:
            async for event in self._call:
                yield event
        finally:
            self._call.cancel()

    def cancel(self) -> None:
        self._call.cancel()

    async def collect(self, on_event: Callable[[omni_pb2.GenerateEvent], None] | None = None) -> Result:
        result = Result()
        async for event in self:
            if on_event is not None:
                on_event(event)
            result.add(event)
        return result


class _Client(Generic[StreamT]):
    """What the sync and the asyncio client share: the channel, the API key, the deadline, Generate."""

    _api: ClassVar[Any]  # grpc or grpc.aio
    _stream: ClassVar[Callable[[Any], Any]]  # EventStream or AsyncEventStream

    def __init__(
        self,
        address: str,
        *,
        api_key: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        tls: bool = False,
        timeout_s: float = 120.0,
        max_message_bytes: int = 64 << 20,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._channel = _channel(self._api, address, credentials, tls, max_message_bytes)
        self._stub = omni_pb2_grpc.OmniStub(self._channel)
        self.metadata = tuple(metadata) + (auth.bearer(api_key) if api_key else ())
        self.timeout_s = timeout_s

    def generate(
        self,
        prompt: str | None = None,
        *,
        request: omni_pb2.GenerateRequest | None = None,
        timeout_s: float | None = None,
        **kwargs,
    ) -> StreamT:
        """Send a request (`request`, or one built by `build_request(prompt, **kwargs)`); its events."""
        req = request if request is not None else build_request(prompt, **kwargs)
        return self._stream(
            self._stub.Generate(req, timeout=timeout_s or self.timeout_s, metadata=self.metadata)
        )


class OmniClient(_Client[EventStream]):
    """Sync client of a gateway's Omni API (`address` HOST:PORT; TLS when `credentials` or `tls`)."""

    _api = grpc
    _stream = EventStream

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> OmniClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncOmniClient(_Client[AsyncEventStream]):
    """asyncio client of a gateway's Omni API; the same arguments as OmniClient."""

    _api = grpc.aio
    _stream = AsyncEventStream

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncOmniClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
