"""The gateway's encode cache with a fake encoder whose calls end when the test says: a clip encoded
ahead is lent to its turn with no second Encode, one the user spoke over is cancelled while being
encoded or released once encoded (so sixteen sessions pausing again and again run one Encode ahead
each, and each turn gets its grown clip), a conversation's earlier clips are encoded once and leave
with its window or its end, a lent item is released only once its turn gives it back, leases near
their end are encoded again, the bounds let the least recently used go, and a failed encode ahead is
the turn's to make again."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from omnistage.common.metrics import REGISTRY
from omnistage.common.runtime.errors import DeadlineExceeded
from omnistage.services.gateway.encode_cache import EncodeCache, KeptMedia
from omnistage.services.gateway.validation import MediaPart, PlannedRequest
from omnistage.v1 import common_pb2, encoder_pb2, omni_pb2, tensor_pb2

RATE = 24000
ROWS = 4  # rows of every fake item
ROW_BYTES = 8 * 2  # hidden 8, bfloat16
ITEM_BYTES = ROWS * ROW_BYTES


class FakeStage:
    """MediaStage's `encode` and `release`: each Encode call ends when the test ends it (`end`); its
    items are shm refs with fresh lease ids (expiring `expiry_ms` from now)."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []  # each call's clips
        self._ends: list[asyncio.Future] = []
        self.released: list[int] = []
        self.leases = 0
        self.expiry_ms = 60_000
        self.running: dict[str, int] = {}  # calls under way, per request_id (a session's, a call's)
        self.peak: dict[str, int] = {}  # the most under way at once, per request_id
        self.peak_total = 0
        self.cancelled: list[int] = []  # calls cancelled by their caller
        self.call_of: dict[int, int] = {}  # lease id → the call that made it

    async def encode(self, request_id, parts, paths, timeout_s):
        call = len(self.calls)
        self.calls.append([p.media.data for p in parts])
        end = asyncio.get_running_loop().create_future()
        self._ends.append(end)
        self.running[request_id] = self.running.get(request_id, 0) + 1
        self.peak[request_id] = max(self.peak.get(request_id, 0), self.running[request_id])
        self.peak_total = max(self.peak_total, sum(self.running.values()))
        try:
            await end
        except asyncio.CancelledError:
            self.cancelled.append(call)
            raise
        finally:
            self.running[request_id] -= 1
        return [self._item(call) for _ in parts]

    def _item(self, call: int) -> encoder_pb2.EncodedItem:
        self.leases += 1
        self.call_of[self.leases] = call
        expiry = int(time.time() * 1000) + self.expiry_ms
        shm = tensor_pb2.ShmRef(
            pool_name="p", byte_size=ITEM_BYTES, lease_id=self.leases, lease_expiry_unix_ms=expiry
        )
        ref = tensor_pb2.TensorRef(dtype=tensor_pb2.DTYPE_BFLOAT16, shape=[ROWS, 8], shm=shm)
        return encoder_pb2.EncodedItem(
            kind=encoder_pb2.MEDIA_KIND_AUDIO, num_tokens=ROWS, placeholder_token_id=99, embeddings=ref
        )

    def end(self, call: int, error: BaseException | None = None) -> None:
        if error is None:
            self._ends[call].set_result(None)
        else:
            self._ends[call].set_exception(error)

    def release(self, items) -> None:
        self.released += [i.embeddings.shm.lease_id for i in items]


def clip(n: int) -> bytes:
    return bytes([n % 256, 1]) * 2400  # 100 ms at 24 kHz, its bytes telling clips apart


def part(pcm: bytes, turn: int = 0) -> MediaPart:
    return MediaPart(f"audio (turn {turn})", "audio", omni_pb2.Media(data=pcm), pcm_rate_hz=RATE)


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def lookups(cache: EncodeCache) -> dict[str, float]:
    name, service = "omnistage_gateway_encode_cache_lookups_total", cache.metrics.service
    return {
        r: REGISTRY.get_sample_value(name, {"service": service, "result": r}) or 0.0
        for r in ("hit", "wait", "miss")
    }


def test_a_clip_encoded_ahead_is_lent_to_its_turn_and_encoded_once():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-ahead")
        key = cache.ahead("s1", clip(1), RATE)
        await settle()
        calls_before_turn = list(stage.calls)
        before = lookups(cache)
        turn = asyncio.create_task(cache.lend("s1", [part(clip(1))], 5.0))
        await settle()
        assert not turn.done()  # the turn waits for the encode under way, starts none
        stage.end(0)
        (kept,) = await turn
        after = lookups(cache)
        cache.give_back([kept])
        return stage, key, calls_before_turn, kept, before, after, cache.held

    stage, key, before_turn, kept, before, after, held = run(scenario())
    assert key is not None and before_turn == [[clip(1)]]  # encoding began before the turn existed
    assert stage.calls == [[clip(1)]]  # and was the turn's only Encode
    assert kept.item.embeddings.shm.lease_id == 1
    assert after["wait"] - before["wait"] == 1 and after["miss"] == before["miss"]
    assert stage.released == [] and held == 1  # kept for the conversation's later turns


def test_a_clip_the_user_spoke_over_is_cancelled_while_encoding_and_released_once_encoded():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-drop")
        key = cache.ahead("s1", clip(1), RATE)
        await settle()
        cache.drop("s1", key)  # still being encoded: the encoder stops
        await settle()
        later = cache.ahead("s1", clip(2), RATE)  # the session's next pause
        await settle()
        stage.end(1)
        await settle()
        cache.drop("s1", later)  # encoded already: its lease goes back
        return stage, later, cache.held

    stage, later, held = run(scenario())
    assert stage.cancelled == [0] and later is not None
    assert stage.calls == [[clip(1)], [clip(2)]] and stage.released == [1] and held == 0


def _said(n: int) -> bytes:
    """A session's speech up to its n-th pause: each pause's clip the one before it, grown."""
    return b"".join(clip(i) for i in range(n + 1))


def test_pauses_of_many_sessions_encode_at_most_one_clip_each_and_the_turn_uses_its_grown_clip():
    sessions, pauses = 16, 5

    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 4 * sessions, 1 << 24, service="t-bound")
        for p in range(pauses):  # the encoder never finishes in time: every pause is spoken over
            for s in range(sessions):
                key = cache.ahead(f"s{s}", _said(p), RATE)
                await settle()
                if p < pauses - 1:
                    cache.drop(f"s{s}", key)  # the user spoke on
            await settle()
        before = len(stage.calls)
        turns = [
            asyncio.create_task(cache.lend(f"s{s}", [part(_said(pauses - 1))], 5.0)) for s in range(sessions)
        ]
        await settle()
        for call in range(before - sessions, before):
            stage.end(call)
        lent = await asyncio.gather(*turns)
        return stage, before, lent

    stage, before, lent = run(scenario())
    assert len(stage.calls) == before == sessions * pauses  # the turns started no Encode of their own
    assert max(stage.peak.values()) == 1 and stage.peak_total == sessions  # one clip each at a time
    assert len(stage.cancelled) == sessions * (pauses - 1)  # every pause spoken over: cancelled
    for (kept,) in lent:  # each turn has the grown clip's item, not an earlier pause's
        assert stage.calls[stage.call_of[kept.item.embeddings.shm.lease_id]] == [_said(pauses - 1)]


def test_one_clip_ahead_at_a_time_per_session():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-one")
        first = cache.ahead("s1", clip(1), RATE)
        second = cache.ahead("s1", clip(2), RATE)  # the first still being encoded
        other = cache.ahead("s2", clip(2), RATE)
        again = cache.ahead("s1", clip(1), RATE)  # the same clip: already under way
        await settle()
        return stage, first, second, other, again

    stage, first, second, other, again = run(scenario())
    assert first is not None and second is None and other is not None and again == first
    assert stage.calls == [[clip(1)], [clip(2)]]


def test_a_conversation_encodes_each_clip_once_and_its_window_and_end_release_them():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-window")

        async def turn(*clips: bytes):
            lending = asyncio.create_task(cache.lend("c1", [part(c, i) for i, c in enumerate(clips)], 5.0))
            await settle()
            for call in range(len(stage._ends)):
                if not stage._ends[call].done():
                    stage.end(call)
            lent = await lending
            cache.give_back(lent)
            return [k.item.embeddings.shm.lease_id for k in lent]

        first = await turn(clip(1))
        second = await turn(clip(1), clip(2))
        released_after_second = list(stage.released)
        third = await turn(clip(2), clip(3))  # the window moved on: clip 1 leaves
        released_after_third = list(stage.released)
        cache.end("c1")
        return stage, first, second, third, released_after_second, released_after_third, cache.held

    stage, first, second, third, after_second, after_third, held = run(scenario())
    assert stage.calls == [[clip(1)], [clip(2)], [clip(3)]]  # one Encode per clip, of that clip only
    assert first == [1] and second == [1, 2] and third == [2, 3]
    assert after_second == [] and after_third == [1]
    assert sorted(stage.released) == [1, 2, 3] and held == 0


def test_a_lent_item_is_released_only_when_its_turn_gives_it_back():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-lent")
        cache.ahead("s1", clip(1), RATE)
        await settle()
        stage.end(0)
        await settle()
        lent = await cache.lend("s1", [part(clip(1))], 5.0)
        cache.end("s1")  # the session ended while the turn's thinker call had not taken the rows yet
        released_while_lent = list(stage.released)
        cache.give_back(lent)
        return stage, released_while_lent, cache.held

    stage, while_lent, held = run(scenario())
    assert while_lent == [] and stage.released == [1] and held == 0


def test_the_bounds_let_the_least_recently_used_go():
    """Use, not age, orders them (a fake clock: one tick a use): a's clip, lent again after b's was
    made, outlives b's."""

    async def scenario():
        stage, ticks = FakeStage(), itertools.count()
        cache = EncodeCache(stage, 2, 1 << 20, service="t-bound", clock=lambda: next(ticks))
        for n, owner in enumerate(("a", "b")):
            cache.ahead(owner, clip(n), RATE)
            await settle()
            stage.end(n)
            await settle()
        cache.give_back(await cache.lend("a", [part(clip(0))], 5.0))  # a's clip used again
        cache.ahead("c", clip(2), RATE)
        await settle()
        stage.end(2)
        await settle()
        by_count = (list(stage.released), cache.held)
        small = EncodeCache(stage, 8, 2 * ITEM_BYTES, service="t-bytes", clock=lambda: next(ticks))
        for n, owner in enumerate(("d", "e", "f"), start=3):
            small.ahead(owner, clip(n), RATE)
            await settle()
            stage.end(n)
            await settle()
        return by_count, stage.released, small.held

    (by_count, held_by_count), released, held_by_bytes = run(scenario())
    assert by_count == [2] and held_by_count == 2  # b's clip (lease 2): the least recently used
    assert released == [2, 4] and held_by_bytes == 2  # d's: past the bytes' bound


def test_an_item_whose_lease_is_near_its_end_is_encoded_again():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-expiry")
        stage.expiry_ms = 1000  # within the cache's margin
        cache.ahead("s1", clip(1), RATE)
        await settle()
        stage.end(0)
        await settle()
        stage.expiry_ms = 60_000
        lending = asyncio.create_task(cache.lend("s1", [part(clip(1))], 5.0))
        await settle()
        stage.end(1)
        lent = await lending
        cache.give_back(lent)
        return stage, lent

    stage, lent = run(scenario())
    assert stage.calls == [[clip(1)], [clip(1)]] and stage.released == [1]
    assert lent[0].item.embeddings.shm.lease_id == 2


def test_a_failed_encode_ahead_is_made_again_by_the_turn_and_the_turns_own_failure_is_its_error():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-fail")
        cache.ahead("s1", clip(1), RATE)
        lending = asyncio.create_task(cache.lend("s1", [part(clip(1))], 5.0))
        await settle()
        stage.end(0, RuntimeError("encoder gone"))
        await settle()
        stage.end(1)
        lent = await lending
        cache.give_back(lent)
        failing = asyncio.create_task(cache.lend("s1", [part(clip(2))], 5.0))
        await settle()
        stage.end(2, RuntimeError("items[0] (audio): too long"))
        with pytest.raises(RuntimeError, match="too long"):
            await failing
        waiting = asyncio.create_task(cache.lend("s1", [part(clip(3))], 0.05))
        with pytest.raises(DeadlineExceeded, match="encoder"):
            await waiting
        stage.end(3)
        await settle()
        return stage, lent, cache.held

    stage, lent, held = run(scenario())
    assert stage.calls == [[clip(1)], [clip(1)], [clip(2)], [clip(3)]]
    assert lent[0].item.embeddings.shm.lease_id == 1  # the fake's leases count the items it made
    # clip 1 left with the window of the turn after it; clip 3, encoded after its turn gave up, stays
    assert stage.released == [1] and held == 1


def test_a_turns_media_lend_their_refs_to_the_thinker_and_give_them_back_at_started():
    async def scenario():
        stage = FakeStage()
        cache = EncodeCache(stage, 8, 1 << 20, service="t-media")
        request = PlannedRequest("c1", (), "", common_pb2.SamplingParams(), (), (part(clip(1)),))
        media = KeptMedia(cache, request)
        getting = asyncio.create_task(media.for_call(5.0))
        await settle()
        stage.end(0)
        items = await getting
        refs = media.thinker_items()
        users_before = cache._kept[next(iter(cache._kept))].users
        media.taken()
        users_after = cache._kept[next(iter(cache._kept))].users
        media.release()  # the run's end: nothing more to give back
        return items, refs, users_before, users_after, stage.released

    items, refs, before, after, released = run(scenario())
    assert len(items) == 1 and [r.caller_keeps_lease for r in refs] == [True]
    assert (before, after) == (1, 0) and released == []
