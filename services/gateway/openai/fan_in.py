"""The events of several Omni streams as one stream of (index, event): a chat answer's `n` choices.

Each stream is read by its own task up to its Finish (then closed, which lets its call end by
itself), into one bounded queue: a slow client holds every choice's stream back, nothing piles up.
The first error of any stream ends the whole; leaving early (the client went away) cancels every
stream still open, which cancels its call.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence

from omnistage.common.runtime.deadlines import cancel_and_wait
from omnistage.v1 import omni_pb2

# Events waiting for the client, all choices together.
QUEUE_EVENTS = 64
# How long leaving waits for the readers' ends (each bounds its own call's end).
_STOP_S = 10.0
_DONE = object()


async def fan_in(
    streams: Sequence[AsyncIterator[omni_pb2.GenerateEvent]],
) -> AsyncIterator[tuple[int, omni_pb2.GenerateEvent]]:
    """(index of the stream, event) in arrival order until every stream reached its Finish or end."""
    queue: asyncio.Queue = asyncio.Queue(QUEUE_EVENTS)

    async def read(index: int, stream: AsyncIterator[omni_pb2.GenerateEvent]) -> None:
        try:
            async with contextlib.aclosing(stream) as events:
                async for event in events:
                    await queue.put((index, event))
                    if event.WhichOneof("event") == "finish":
                        break
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put((index, exc))
            return
        await queue.put((index, _DONE))

    readers = [asyncio.ensure_future(read(i, s)) for i, s in enumerate(streams)]
    open_streams = len(readers)
    try:
        while open_streams:
            index, item = await queue.get()
            if item is _DONE:
                open_streams -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        await cancel_and_wait([r for r in readers if not r.done()], _STOP_S, "openai front: choices' streams")
