"""Request bodies and headers in: JSON only when it says so, counted before it is parsed, the client's
`x-request-id`; and large bodies parsed and translated in a small pool of their own, their bytes in
flight bounded, so that health, small requests and the gateway's gRPC API (the same event loop) never
wait behind a burst of them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from omnistage.common.request_ids import MAX_REQUEST_ID_CHARS, valid_request_id
from omnistage.services.gateway.openai.errors import HttpError, busy
from starlette.requests import Request

# Bodies from this size on are parsed in the pool; smaller ones (a chat turn, a canary) at once.
INLINE_PARSE_BYTES = 256 * 1024
# The most '{', '[' and ',' a body may hold (strings included), counted before it is parsed: json.loads
# holds the GIL, even in a worker thread, for ~0.25 s per million values, so `[{},{},...]` of 8 M
# messages would stall the event loop ~2 s. The largest request the gateway takes (max_messages x
# max_parts_per_message parts) needs ~50 k; base64 media has none.
MAX_JSON_VALUES = 500_000
# Threads parsing large bodies: one. Parsing holds the GIL in long C calls (json.loads of 1.8 MB of token
# ids: ~50 ms); with one such thread the event loop, the only other one wanting the GIL, gets it as
# soon as a call ends, while two threads hand it to each other and starve the loop for seconds.
PARSE_THREADS = 1
# Large bodies in flight together (being read, waiting for the pool or in it); beyond either, 429 at
# once (a lone body always passes). Bytes bound the memory; JSON values bound the parsing the event
# loop waits behind (a million: ~0.25 s; base64 media is bytes, not values).
MAX_LARGE_BYTES = 256 * 1024 * 1024
MAX_LARGE_VALUES = 1_000_000
JSON_MEDIA_TYPE = "application/json"
T = TypeVar("T")


def json_values(raw: bytes) -> int:
    """The `{`, `[` and `,` of a body, bounded before it is parsed (400 naming `body`)."""
    if not raw:
        raise HttpError(400, "body: expected a JSON object", param="body")
    values = raw.count(b"{") + raw.count(b"[") + raw.count(b",")
    if values > MAX_JSON_VALUES:
        raise HttpError(
            400, f"body: {values} JSON objects, arrays and commas, at most {MAX_JSON_VALUES}", param="body"
        )
    return values


def decode(raw: bytes) -> Any:
    """The JSON of a body whose values were counted (400 naming `body`)."""
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise HttpError(400, f"body: not valid JSON: {exc}", param="body") from None
    except RecursionError:
        raise HttpError(400, "body: JSON nested too deeply", param="body") from None


def loads(raw: bytes) -> Any:
    """The JSON of a body, its values counted first."""
    json_values(raw)
    return decode(raw)


def require_json(request: Request) -> None:
    """Bodies are JSON and say so: a form or text body is refused, not parsed on a guess."""
    value = request.headers.get("content-type", "")
    if value.partition(";")[0].strip().lower() != JSON_MEDIA_TYPE:
        got = f"got {value!r}" if value else "no Content-Type was sent"
        raise HttpError(
            400,
            f"content-type: expected {JSON_MEDIA_TYPE}, {got}",
            param="content-type",
            code="invalid_content_type",
        )


def request_id(request: Request) -> str:
    """The client's `x-request-id` ("" when none was sent); an invalid one is refused, not replaced."""
    rid = request.headers.get("x-request-id", "")
    if not valid_request_id(rid):
        raise HttpError(
            400,
            f"x-request-id: must be printable and at most {MAX_REQUEST_ID_CHARS} characters",
            param="x-request-id",
            code="invalid_value",
        )
    return rid


def echoed_request_id(request: Request) -> str:
    """The `x-request-id` an error response repeats: the client's when it is valid, else none."""
    rid = request.headers.get("x-request-id", "")
    return rid if valid_request_id(rid) else ""


def _content_length(request: Request) -> int | None:
    try:
        return int(request.headers["content-length"])
    except (KeyError, ValueError):
        return None


class LargeBodies:
    """Large bodies in flight (their bytes and JSON values, each bounded: 429 beyond) and the pool that
    parses them."""

    def __init__(
        self,
        threads: int = PARSE_THREADS,
        max_bytes: int = MAX_LARGE_BYTES,
        max_values: int = MAX_LARGE_VALUES,
    ) -> None:
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="openai-body")
        self.max_bytes = max_bytes
        self.max_values = max_values
        self.bytes = self.values = 0

    @contextlib.contextmanager
    def hold(self, size: int = 0, values: int = 0) -> Iterator[None]:
        """Hold `size` bytes and `values` JSON values; 429 when they do not fit beside those in flight."""
        if (self.bytes and self.bytes + size > self.max_bytes) or (
            self.values and self.values + values > self.max_values
        ):
            raise busy(
                f"the front is parsing large request bodies ({self.bytes >> 20} MiB, {self.values} JSON "
                f"values; at most {self.max_bytes >> 20} MiB, {self.max_values} values): retry later"
            )
        self.bytes += size
        self.values += values
        try:
            yield
        finally:
            self.bytes -= size
            self.values -= values

    async def run(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.pool, work)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class BodyReader:
    """`translate(json body, **kwargs)` of a request: a small body at once, a large one in the pool."""

    def __init__(self, large: LargeBodies) -> None:
        self.large = large

    async def translate(self, request: Request, translate: Callable[..., T], **kwargs: Any) -> T:
        require_json(request)
        declared = _content_length(request)
        if declared is not None and declared < INLINE_PARSE_BYTES:
            return translate(loads(await request.body()), **kwargs)
        with self.large.hold(size=declared or 0):  # chunked: its size is known once read
            raw = await request.body()
            if len(raw) < INLINE_PARSE_BYTES:
                return translate(loads(raw), **kwargs)
            with self.large.hold(size=len(raw) - (declared or 0), values=json_values(raw)):
                return await self.large.run(functools.partial(self._parsed, translate, kwargs, raw))

    @staticmethod
    def _parsed(translate: Callable[..., T], kwargs: dict[str, Any], raw: bytes) -> T:
        return translate(decode(raw), **kwargs)
