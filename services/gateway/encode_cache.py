"""The encoder's outputs of conversations' spoken turns, kept for their later turns and made ahead of
a turn's end.

Converse answers each turn from the call's history, whose spoken turns all go to the thinker again.
Without this cache every turn encoded its whole window again, the newest clip only once the turn had
ended (the encoder on the path from the user's last word to the answer), and a clip encoded again need
not give the same bits on a GPU (the thinker's prefix cache, which hashes the rows, then missed from
the first clip on). Here a clip is encoded once per conversation: its entry is keyed by its owner (the
Converse call's request_id, which a Realtime session sets to its own id) and its content, and a
Realtime session starts the newest clip's encoding while VAD still waits for the user's silence to
last (`ahead`), so that the turn finds it done or under way.

The cache holds the items' leases. A turn borrows them for its thinker call (the thinker copies the
rows and leaves the lease: `caller_keeps_lease`) and gives them back at its `started` or its end. An
entry leaves the cache when its owner ends, when its clip leaves the conversation's window, when its
lease is near its end, when a clip encoded ahead does not become a turn (the user spoke on), or, least
recently used first, when the cache is past its bounds; its lease is released then, or when its encode
is done and no turn holds it any more. An encode no turn waits for is cancelled as its entry leaves:
a Realtime session has at most one clip being encoded ahead (a pause it spoke over is cancelled before
its next pause starts the grown clip), so pauses never multiply the encoder's work.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from omnistage.common import metrics
from omnistage.common.runtime.deadlines import within
from omnistage.common.runtime.errors import DeadlineExceeded
from omnistage.services.gateway.media import expiring, thinker_items
from omnistage.services.gateway.validation import MediaPart, PlannedRequest
from omnistage.v1 import encoder_pb2, omni_pb2, tensor_pb2, thinker_pb2

_log = logging.getLogger(__name__)

# The deadline of an Encode started ahead of its turn (the encoder's own queue_timeout_s default): no
# client waits on it, and a turn that does waits at most its own deadline.
AHEAD_TIMEOUT_S = 30.0
# A kept item whose lease ends this soon is not lent any more: the turn encodes its clip again.
LEASE_MARGIN_MS = 5000
AHEAD_WHERE = "audio (encoded ahead)"


def content_key(owner: str, part: MediaPart) -> bytes:
    """An entry's key: its owner and its clip's kind, rate and bytes."""
    h = hashlib.blake2b(digest_size=16)
    for piece in (owner.encode(), part.kind.encode(), str(part.pcm_rate_hz).encode()):
        h.update(len(piece).to_bytes(4, "little"))
        h.update(piece)
    h.update(part.media.data)
    return h.digest()


def ref_bytes(ref: tensor_pb2.TensorRef) -> int:
    """The bytes a ref holds: its slice of the encoder's pool (shm or CUDA IPC), or its inline bytes."""
    kind = ref.WhichOneof("payload")
    return (
        ref.shm.byte_size if kind == "shm" else ref.cuda.byte_size if kind == "cuda" else len(ref.inline_data)
    )


@dataclass(eq=False)
class Kept:
    """One clip's encoding: its Encode call (`task`), then the item it gave."""

    key: bytes
    owner: str
    ahead: bool  # encoded ahead of its turn
    task: asyncio.Task | None = None
    users: int = 0  # turns whose thinker call has not taken it yet
    turned: bool = False  # a turn has used it: it is the conversation's now, not a guess
    out: bool = False  # left the cache: released once its encode is done and no turn holds it
    released: bool = False
    nbytes: int = 0
    used_at: float = 0.0

    @property
    def item(self) -> encoder_pb2.EncodedItem | None:
        """The encoder's item, once the call gave one."""
        t = self.task
        return t.result() if t is not None and t.done() and not t.cancelled() and not t.exception() else None


class CacheMetrics:
    """The cache's Prometheus series (docs/metrics.md)."""

    def __init__(self, service: str) -> None:
        self.service = service
        self._lookups = metrics.counter(
            "gateway_encode_cache_lookups",
            "Spoken turns' clips a Converse turn asked the encode cache for, by result: hit (encoded "
            "already), wait (being encoded: ahead of the turn), miss (encoded by the turn)",
            ("result",),
        )
        self._ahead = metrics.counter(
            "gateway_encode_cache_ahead",
            "Clips a Realtime session asked to encode ahead of its turn, by outcome: started, skipped "
            "(the cache full, or one of the session's still being encoded), unused (released, or its "
            "encode cancelled, without a turn using it: the user spoke on, or the session ended), failed",
            ("outcome",),
        )
        self._items = metrics.gauge(
            "gateway_encode_cache_items", "Encoder items the encode cache holds (their leases), in flight too"
        )
        self._bytes = metrics.gauge("gateway_encode_cache_bytes", "Bytes of the encoder items it holds")

    def lookup(self, result: str) -> None:
        self._lookups.labels(self.service, result).inc()

    def ahead(self, outcome: str) -> None:
        self._ahead.labels(self.service, outcome).inc()

    def held(self, items: int, nbytes: int) -> None:
        self._items.labels(self.service).set(items)
        self._bytes.labels(self.service).set(nbytes)


class EncodeCache:
    """Encoded clips of conversations (see the module's docstring); `stage` is the gateway's MediaStage
    (its `encode` and `release`). At most `max_items` entries and `max_bytes` of items that no turn
    holds now; an entry a turn holds stays past them until the turn gives it back."""

    def __init__(
        self,
        stage: Any,
        max_items: int,
        max_bytes: int,
        service: str = "gateway",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stage = stage
        self.max_items, self.max_bytes = max_items, max_bytes
        self.clock = clock
        self.metrics = CacheMetrics(service)
        self._kept: dict[bytes, Kept] = {}
        self._held: set[Kept] = set()  # not released yet: in the cache, or on their way out of it
        self._bytes = 0

    @property
    def held(self) -> int:
        return len(self._held)

    # -- ahead of a turn (the Realtime session) -----------------------------------------------------

    def ahead(self, owner: str, pcm: bytes, rate: int) -> bytes | None:
        """Start encoding a clip that may become `owner`'s next spoken turn; its key (None: skipped, the
        cache being full or the owner's clip for a turn not taken yet still being encoded; a clip it
        dropped was cancelled: at most one of an owner's clips is encoded ahead at a time)."""
        part = MediaPart(AHEAD_WHERE, "audio", omni_pb2.Media(data=pcm), pcm_rate_hz=rate)
        key = content_key(owner, part)
        if key in self._kept:
            return key
        self._sweep()
        kept = self._kept.values()
        busy = any(k.owner == owner and k.ahead and not k.turned and not k.task.done() for k in kept)
        if busy or not self._room():
            self.metrics.ahead("skipped")
            return None
        self._add(key, owner, part, AHEAD_TIMEOUT_S, ahead=True)
        self.metrics.ahead("started")
        return key

    def drop(self, owner: str, key: bytes) -> None:
        """The clip encoded ahead will not be a turn (the user spoke on): it leaves, its encode cancelled if
        still running, unless a turn used it (a clip whose audio then grew has another key: never reused)."""
        kept = self._kept.get(key)
        if kept is not None and kept.owner == owner and not kept.turned:
            self._out(kept)

    def end(self, owner: str) -> None:
        """`owner`'s conversation (or Realtime session) ended: its entries leave."""
        for kept in [k for k in self._kept.values() if k.owner == owner]:
            self._out(kept)

    # -- a turn's media ------------------------------------------------------------------------------

    async def lend(self, owner: str, parts: Sequence[MediaPart], timeout_s: float | None) -> list[Kept]:
        """Each part's encoding, held for the caller until `give_back`: kept ones as they are, the rest
        encoded now (one Encode each, at once); the owner's other clips that a turn used leave the cache
        (the conversation's window moved on). An encoder refusal names the part."""
        self._sweep()
        lent: list[Kept] = []
        try:
            for part in parts:
                lent.append(self._find(owner, part, timeout_s))
            for kept in [k for k in self._kept.values() if k.owner == owner and k.turned]:
                if all(kept is not k for k in lent):
                    self._out(kept)
            for i, part in enumerate(parts):
                await self._ready(lent, i, owner, part, timeout_s)
        except BaseException:
            self.give_back(lent)
            raise
        return lent

    def give_back(self, lent: Sequence[Kept]) -> None:
        """The turn no longer needs these (its thinker copied the rows, or it ended)."""
        for kept in lent:
            kept.users -= 1
            self._settle(kept)
        self._make_room()

    async def close(self) -> None:
        """Shutdown: every encode still running is cancelled, every item released."""
        for kept in list(self._held):
            if kept.task is not None and not kept.task.done():
                kept.task.cancel()
            kept.users = 0
            self._out(kept)
        await asyncio.gather(*(k.task for k in self._held if k.task is not None), return_exceptions=True)

    # -- internals -----------------------------------------------------------------------------------

    def _find(self, owner: str, part: MediaPart, timeout_s: float | None) -> Kept:
        """The part's entry, held for a turn: the kept one, else one encoding it now."""
        key = content_key(owner, part)
        kept = self._kept.get(key)
        if (
            kept is not None
            and kept.task.done()
            and (kept.item is None or expiring([kept.item], LEASE_MARGIN_MS))
        ):
            self._out(kept)
            kept = None
        if kept is None:
            kept = self._add(key, owner, part, timeout_s, ahead=False)
            self.metrics.lookup("miss")
        else:
            self.metrics.lookup("hit" if kept.task.done() else "wait")
        kept.users += 1
        kept.turned, kept.used_at = True, self.clock()
        return kept

    async def _ready(
        self, lent: list[Kept], i: int, owner: str, part: MediaPart, timeout_s: float | None
    ) -> None:
        """Wait for `lent[i]`'s encode; one made ahead that failed is made again for the turn (its own
        encode's failure is the turn's)."""
        kept = lent[i]
        try:
            await self._wait(kept, timeout_s)
            return
        except Exception:
            if not (kept.ahead and kept.task.done()):
                raise
        lent[i] = self._find(owner, part, timeout_s)
        self.give_back([kept])
        await self._wait(lent[i], timeout_s)

    async def _wait(self, kept: Kept, timeout_s: float | None) -> None:
        try:
            await within(asyncio.shield(kept.task), timeout_s)
        except TimeoutError:
            raise DeadlineExceeded("encoder: the turn's audio was not encoded within its deadline") from None

    def _add(self, key: bytes, owner: str, part: MediaPart, timeout_s: float | None, *, ahead: bool) -> Kept:
        """A new entry, its Encode call started (the owner, the conversation's request_id, names it)."""
        kept = Kept(key, owner, ahead, used_at=self.clock())
        kept.task = asyncio.create_task(self._encode(owner, part, timeout_s), name=f"encode {part.where}")
        kept.task.add_done_callback(lambda _t: self._encoded(kept))
        self._kept[key] = kept
        self._held.add(kept)
        self._report()
        return kept

    async def _encode(
        self, request_id: str, part: MediaPart, timeout_s: float | None
    ) -> encoder_pb2.EncodedItem:
        (item,) = await self.stage.encode(request_id, [part], {}, timeout_s)
        return item

    def _encoded(self, kept: Kept) -> None:
        """The Encode call ended: its item is counted (and released at once if the entry left), or the
        entry goes (a failure: the turn that waits on it gets the error)."""
        task = kept.task
        if task.cancelled() or task.exception() is not None:
            if task.cancelled():
                if kept.ahead and not kept.turned:
                    self.metrics.ahead("unused")
            elif kept.ahead:
                _log.info("encoding a clip ahead of its turn failed: %s", task.exception())
                self.metrics.ahead("failed")
            if self._kept.get(kept.key) is kept:
                del self._kept[kept.key]
            kept.out = kept.released = True
            self._held.discard(kept)
            self._report()
            return
        kept.nbytes = ref_bytes(task.result().embeddings)
        self._bytes += kept.nbytes
        self._settle(kept)
        self._make_room()

    def _out(self, kept: Kept) -> None:
        """The entry leaves the cache; an encode still running that no turn waits for is cancelled (a
        clip the user spoke over, a session's end: the encoder stops spending on it, and a session's
        next pause never finds it still running beside its new clip)."""
        if self._kept.get(kept.key) is kept:
            del self._kept[kept.key]
        kept.out = True
        if kept.users == 0 and kept.task is not None and not kept.task.done():
            kept.task.cancel()
        self._settle(kept)

    def _settle(self, kept: Kept) -> None:
        """Release an entry that left the cache once its encode is done and no turn holds it."""
        if kept.released or not kept.out or kept.users > 0 or not kept.task.done():
            return
        kept.released = True
        if (item := kept.item) is not None:
            if kept.ahead and not kept.turned:
                self.metrics.ahead("unused")
            self.stage.release([item])
            self._bytes -= kept.nbytes
        self._held.discard(kept)
        self._report()

    def _sweep(self) -> None:
        """Entries whose leases are near their end leave (a turn would encode their clips again)."""
        for kept in [k for k in self._kept.values() if k.users == 0 and k.item is not None]:
            if expiring([kept.item], LEASE_MARGIN_MS):
                self._out(kept)

    def _make_room(self, spare: int = 0) -> None:
        """Past a bound (with room for `spare` more entries): the least recently used entries that no
        turn holds and whose encode is done leave."""
        while len(self._kept) + spare > self.max_items or self._bytes > self.max_bytes:
            free = [k for k in self._kept.values() if k.users == 0 and k.task.done()]
            if not free:
                return
            self._out(min(free, key=lambda k: k.used_at))

    def _room(self) -> bool:
        """Room for one more entry, made by letting the least recently used go."""
        self._make_room(spare=1)
        return len(self._kept) < self.max_items and self._bytes <= self.max_bytes

    def _report(self) -> None:
        self.metrics.held(len(self._held), self._bytes)


class KeptMedia:
    """A Converse turn's media through the cache, in EncodedMedia's interface (answer.py): borrowed for
    the turn's thinker call, which copies the rows and leaves the leases with the cache."""

    def __init__(self, cache: EncodeCache, request: PlannedRequest) -> None:
        self.cache = cache
        self.request = request  # its request_id is the conversation's: the entries' owner
        self.items: list[encoder_pb2.EncodedItem] = []
        self._lent: list[Kept] = []

    async def for_call(self, remaining_s: float | None) -> list[encoder_pb2.EncodedItem]:
        if self.request.media and not self._lent:
            self._lent = await self.cache.lend(self.request.request_id, self.request.media, remaining_s)
            self.items = [k.item for k in self._lent]
        return self.items

    def thinker_items(self) -> list[thinker_pb2.MultimodalEmbedding]:
        items = thinker_items(self.items)
        for item in items:
            item.caller_keeps_lease = True
        return items

    def taken(self) -> None:
        """The thinker took the call (`started`): it copied the rows."""
        self.release()

    def release(self) -> None:
        lent, self._lent = self._lent, []
        self.cache.give_back(lent)
