import os
import stat
import time

import pytest
import torch
from omnistage.common import metrics
from omnistage.common.transport import TransportContext, TransportError, TransportOptions, decode, encode
from omnistage.common.transport.host import SHM_DIR, segment_owner_pid
from omnistage.common.transport.shm_pool import ShmAttachments, ShmPool
from prometheus_client import REGISTRY


@pytest.fixture
def pool():
    p = ShmPool(1 << 20, lease_ttl_s=30.0, max_leases=8)
    yield p
    p.close()


@pytest.fixture
def attachments():
    a = ShmAttachments()
    yield a
    a.close()


def _service_label():
    return {"service": metrics.process_service()}


def _fallbacks(reason):
    return (
        REGISTRY.get_sample_value(
            "omnistage_transport_fallbacks_total", {"service": metrics.process_service(), "reason": reason}
        )
        or 0.0
    )


def test_segment_is_private_named_and_removed_on_close():
    p = ShmPool(1 << 16)
    path = os.path.join(SHM_DIR, p.name)
    assert segment_owner_pid(p.name) == os.getpid()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert os.stat(path).st_size == p.segment.byte_size
    p.close()
    assert not os.path.exists(path)
    p.close()  # idempotent


def test_consumer_release_returns_the_slice(pool, attachments):
    ref = pool.put(torch.arange(1000, dtype=torch.int64))
    assert ref.lease_id != 0 and pool.arena.used_bytes >= 8000 and pool.arena.active_leases == 1
    view = attachments.view(ref).view(torch.int64)
    assert torch.equal(view, torch.arange(1000))
    attachments.release(ref)
    assert pool.arena.reclaim() == 1
    assert pool.arena.used_bytes == 0 and pool.arena.active_leases == 0
    again = pool.put(torch.zeros(1000, dtype=torch.int64))
    assert again.offset == ref.offset and again.lease_id != ref.lease_id


def test_free_ranges_coalesce_after_out_of_order_releases(pool, attachments):
    refs = [pool.put(torch.zeros(64 << 10, dtype=torch.uint8)) for _ in range(16)]
    refs = [r for r in refs if r is not None]
    assert len(refs) == 8  # max_leases bounds the pool too
    for r in refs[1::2] + refs[0::2]:
        attachments.release(r)
    assert pool.arena.reclaim() == 8
    whole = pool.put(torch.zeros(pool.arena.capacity, dtype=torch.uint8))
    assert whole is not None and whole.byte_size == pool.arena.capacity


def test_unreleased_lease_is_reclaimed_after_expiry(attachments):
    p = ShmPool(1 << 16, lease_ttl_s=0.05)
    try:
        ref = p.put(torch.ones(100))
        assert p.arena.reclaim() == 0 and p.arena.active_leases == 1
        deadline = time.monotonic() + 10
        while p.arena.active_leases and time.monotonic() < deadline:
            time.sleep(0.02)
            p.arena.reclaim()
        assert p.arena.active_leases == 0 and p.arena.expired_total == 1 and p.arena.used_bytes == 0
        attachments.release(ref)  # a consumer that wakes up late changes nothing
        assert p.arena.reclaim() == 0
    finally:
        p.close()


def test_expired_ref_is_refused_by_decode_and_counted():
    opts = TransportOptions(shm_pool_bytes=1 << 16, lease_ttl_s=0.05, shm_threshold_bytes=0)
    with TransportContext(opts) as producer, TransportContext() as consumer:
        before = (
            REGISTRY.get_sample_value("omnistage_transport_leases_expired_total", _service_label()) or 0.0
        )
        ref = encode(torch.ones(100), transport=producer)
        time.sleep(0.1)
        with pytest.raises(TransportError, match="expired"):
            decode(ref, transport=consumer)
        encode(torch.ones(100), transport=producer)  # the next allocation reclaims the expired slice
        assert (
            REGISTRY.get_sample_value("omnistage_transport_leases_expired_total", _service_label())
            == before + 1
        )


def test_full_pool_waits_briefly_then_falls_back_inline_and_counts():
    opts = TransportOptions(shm_pool_bytes=1 << 20, shm_threshold_bytes=0, alloc_wait_s=0.05)
    with TransportContext(opts) as producer, TransportContext() as consumer:
        half = torch.arange(128 << 10, dtype=torch.float32)  # 512 KiB
        held = [encode(half, transport=producer) for _ in range(2)]
        assert [r.WhichOneof("payload") for r in held] == ["shm", "shm"]
        full_before, large_before = _fallbacks("pool_full"), _fallbacks("too_large")
        spill = encode(half, transport=producer)
        assert spill.WhichOneof("payload") == "inline_data"
        assert torch.equal(decode(spill, transport=consumer), half)
        assert _fallbacks("pool_full") == full_before + 1
        decode(held[0], transport=consumer)  # releases one slice
        assert encode(half, transport=producer).WhichOneof("payload") == "shm"
        assert encode(torch.zeros(2 << 20), transport=producer).WhichOneof("payload") == "inline_data"
        assert _fallbacks("too_large") == large_before + 1


def test_zero_copy_view_holds_the_lease_until_released():
    with (
        TransportContext(TransportOptions(shm_pool_bytes=1 << 20)) as producer,
        TransportContext() as consumer,
    ):
        x = torch.arange(4096, dtype=torch.int32)
        ref = encode(x, transport=producer, force="shm")
        view = decode(ref, transport=consumer, copy=False)
        assert torch.equal(view, x)
        pool = producer.shm_pool()
        assert pool.arena.reclaim() == 0 and pool.arena.active_leases == 1
        consumer.release(ref)
        assert pool.arena.reclaim() == 1 and pool.arena.used_bytes == 0
        copied = decode(encode(x, transport=producer, force="shm"), transport=consumer)
        assert pool.arena.reclaim() == 1 and torch.equal(copied, x)


def test_stale_release_does_not_free_the_next_lease(pool, attachments):
    first = pool.put(torch.ones(10))
    attachments.release(first)
    pool.arena.reclaim()
    second = pool.put(torch.ones(10))
    assert second.offset == first.offset
    attachments.release(first)  # a late duplicate of the old release
    assert pool.arena.reclaim() == 0 and pool.arena.active_leases == 1
    attachments.release(second)
    assert pool.arena.reclaim() == 1


def test_attach_validates_name_size_and_bounds(pool, attachments):
    ref = pool.put(torch.ones(10))
    for name in ("../../etc/passwd", "omnistage-1-nothex", "psm_12345"):
        bad = type(ref)()
        bad.CopyFrom(ref)
        bad.pool_name = name
        with pytest.raises(TransportError, match="not an omnistage segment name"):
            attachments.view(bad)
    bad.CopyFrom(ref)
    bad.pool_byte_size += 4096
    with pytest.raises(TransportError, match="bytes, ref says"):
        attachments.view(bad)
    bad.CopyFrom(ref)
    bad.offset = 0  # the lease table, not data
    with pytest.raises(TransportError, match="outside the data region"):
        attachments.view(bad)
    bad.CopyFrom(ref)
    bad.pool_name = f"omnistage-{os.getpid()}-{'0' * 16}"
    with pytest.raises(TransportError, match="is gone"):
        attachments.view(bad)


def test_revoke_takes_back_an_unsent_ref_and_only_our_own():
    with TransportContext(TransportOptions(shm_pool_bytes=1 << 20, shm_threshold_bytes=0)) as ctx:
        ref = encode(torch.ones(1000), transport=ctx)
        arena = ctx.shm_pool().arena
        assert ref.WhichOneof("payload") == "shm" and arena.active_leases == 1
        assert ctx.revoke(ref) is True
        assert arena.active_leases == 0 and arena.used_bytes == 0
        assert ctx.revoke(ref) is False  # already free
        assert ctx.revoke(encode(torch.ones(3))) is False  # inline: nothing to take back
        with TransportContext(TransportOptions(shm_pool_bytes=1 << 20, shm_threshold_bytes=0)) as other:
            foreign = encode(torch.ones(10), transport=other)
            assert ctx.revoke(foreign) is False and other.shm_pool().arena.active_leases == 1


def test_a_copy_that_fails_gives_its_slice_back(pool, monkeypatch):
    from omnistage.common.transport import shm_pool

    def broken_copy(dst, src):
        raise RuntimeError("copy failed")

    monkeypatch.setattr(shm_pool, "copy_bytes", broken_copy)
    with pytest.raises(RuntimeError, match="copy failed"):
        pool.put(torch.ones(1024))
    assert pool.arena.active_leases == 0 and pool.arena.used_bytes == 0
    monkeypatch.undo()
    assert pool.put(torch.ones(1024)) is not None
