import pytest
import torch
from omnistage.common import metrics
from omnistage.common.transport import (
    SUPPORTED_DTYPES,
    TransportContext,
    TransportError,
    TransportOptions,
    decode,
    encode,
)
from omnistage.v1 import tensor_pb2
from prometheus_client import REGISTRY

SHAPES = [(), (0,), (3, 0, 2), (5,), (2, 3, 4)]


def _sample(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=dtype)
    return (torch.randn(shape, generator=g) * 1000).to(dtype)


def _wire(ref):
    """What the consumer sees after a gRPC hop."""
    return tensor_pb2.TensorRef.FromString(ref.SerializeToString())


def _assert_same(y, x):
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    if x.dtype in (torch.bfloat16, torch.float16):  # exact bits, not float equality
        assert torch.equal(y.view(torch.int16), x.contiguous().view(torch.int16))
    else:
        assert torch.equal(y, x)


@pytest.fixture(scope="module")
def producer():
    with TransportContext(TransportOptions(shm_pool_bytes=8 << 20)) as ctx:
        yield ctx


@pytest.fixture(scope="module")
def consumer():
    with TransportContext() as ctx:
        yield ctx


@pytest.mark.parametrize("path", ["inline", "shm"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES, ids=str)
def test_round_trip(producer, consumer, dtype, shape, path):
    x = _sample(shape, dtype)
    ref = encode(x, transport=producer, force=path)
    assert ref.WhichOneof("payload") == ("inline_data" if path == "inline" else "shm")
    _assert_same(decode(_wire(ref), transport=consumer), x)


@pytest.mark.parametrize("path", ["inline", "shm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.bool, torch.int64], ids=str)
def test_non_contiguous_input(producer, consumer, dtype, path):
    base = _sample((6, 8), dtype, seed=1)
    for x in (base.t(), base[::2, 1::3], base.unsqueeze(0).expand(3, 6, 8)):
        assert not x.is_contiguous()
        _assert_same(decode(_wire(encode(x, transport=producer, force=path)), transport=consumer), x)


def test_bf16_special_values_keep_their_bits(producer, consumer):
    bits = torch.tensor([0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8000, 0x0000], dtype=torch.int32).to(torch.int16)
    x = bits.view(torch.bfloat16)  # +inf, -inf, a NaN payload, smallest subnormal, -0, +0
    for path in ("inline", "shm"):
        y = decode(_wire(encode(x, transport=producer, force=path)), transport=consumer)
        assert torch.equal(y.view(torch.int16), bits)


def test_inline_bytes_are_little_endian_row_major():
    x = torch.tensor([[1, 2], [3, 258]], dtype=torch.int16).t()
    assert encode(x).inline_data == bytes([1, 0, 3, 0, 2, 0, 2, 1])


@pytest.mark.parametrize("path", ["shm", "inline"])
def test_256_mib_round_trip(path):
    x = torch.randn(64 << 20)  # 256 MiB of float32
    with TransportContext(TransportOptions(shm_pool_bytes=(256 << 20) + (1 << 20))) as ctx:
        ref = encode(x, transport=ctx, force=path)
        assert ref.WhichOneof("payload") == ("shm" if path == "shm" else "inline_data")
        assert torch.equal(decode(ref, transport=ctx), x)


def test_automatic_path_follows_threshold_and_peer_host():
    opts = TransportOptions(shm_threshold_bytes=1024, shm_pool_bytes=1 << 20)
    with TransportContext(opts) as ctx:
        assert encode(torch.zeros(255), transport=ctx).WhichOneof("payload") == "inline_data"
        assert encode(torch.zeros(256), transport=ctx).WhichOneof("payload") == "shm"
        assert encode(torch.zeros(256)).WhichOneof("payload") == "inline_data"  # no context, no pool
        same = encode(torch.zeros(256), transport=ctx, peer_host_id=ctx.host_id)
        assert same.WhichOneof("payload") == "shm"
        other = encode(torch.arange(256.0), transport=ctx, peer_host_id="elsewhere:boot")
        assert other.WhichOneof("payload") == "inline_data"
        assert torch.equal(decode(other), torch.arange(256.0))


def test_shm_ref_from_another_host_is_refused_and_not_mapped(producer):
    with TransportContext() as consumer:
        ref = encode(torch.ones(1000), transport=producer, force="shm")
        ref.host_id = "other-host:other-boot"
        with pytest.raises(TransportError, match="cannot be mapped on host"):
            decode(ref, transport=consumer)
        assert consumer.shm_attachments._pools == {}


def test_forcing_shared_memory_across_hosts_or_without_context_fails(producer):
    with pytest.raises(TransportError, match="peer is on host"):
        encode(torch.ones(4), transport=producer, force="shm", peer_host_id="other-host:boot")
    with pytest.raises(TransportError, match="needs a TransportContext"):
        encode(torch.ones(4), force="shm")
    with pytest.raises(ValueError, match="force must be one of"):
        encode(torch.ones(4), transport=producer, force="tcp")
    with pytest.raises(TransportError, match="needs a TransportContext to decode"):
        decode(encode(torch.ones(4), transport=producer, force="shm"))


def test_malformed_refs_are_rejected(producer, consumer):
    ref = encode(torch.ones(4))
    ref.inline_data = ref.inline_data[:-1]
    with pytest.raises(TransportError, match="needs 16 bytes, got 15"):
        decode(ref)
    ref = encode(torch.ones(4), transport=producer, force="shm")
    ref.shape[:] = [5]
    with pytest.raises(TransportError, match="slice has 16"):
        decode(ref, transport=consumer)
    ref = encode(torch.ones(4), transport=producer, force="shm")
    ref.shm.pool_name = "../../etc/passwd"
    with pytest.raises(TransportError, match="not an omnistage segment name"):
        decode(ref, transport=consumer)


def _count(name, **labels):
    return REGISTRY.get_sample_value(name, {"service": metrics.process_service(), **labels}) or 0.0


@pytest.mark.parametrize("path", ["inline", "shm"])
def test_counters_move_for_the_path_taken(producer, consumer, path):
    x = torch.zeros(1000, dtype=torch.float64)
    other = "shm" if path == "inline" else "inline"
    before = {
        (p, d): (
            _count("omnistage_transport_tensors_total", path=p, direction=d),
            _count("omnistage_transport_bytes_total", path=p, direction=d),
        )
        for p in (path, other)
        for d in ("encode", "decode")
    }
    seconds_before = {
        d: _count("omnistage_transport_transfer_seconds_count", path=path, direction=d)
        for d in ("encode", "decode")
    }
    decode(encode(x, transport=producer, force=path), transport=consumer)
    for d in ("encode", "decode"):
        assert (
            _count("omnistage_transport_transfer_seconds_count", path=path, direction=d)
            == seconds_before[d] + 1
        )
        assert _count("omnistage_transport_tensors_total", path=path, direction=d) == before[path, d][0] + 1
        assert _count("omnistage_transport_bytes_total", path=path, direction=d) == before[path, d][1] + 8000
        assert _count("omnistage_transport_tensors_total", path=other, direction=d) == before[other, d][0]


def test_missing_shm_dir_falls_back_inline_and_counts(tmp_path):
    opts = TransportOptions(shm_dir=str(tmp_path / "no-such-dir"), shm_threshold_bytes=0)
    before = _count("omnistage_transport_fallbacks_total", reason="shm_unavailable")
    with TransportContext(opts) as ctx:
        x = torch.arange(10)
        ref = encode(x, transport=ctx)
        assert ref.WhichOneof("payload") == "inline_data" and torch.equal(decode(ref), x)
        assert ctx.shm_pool() is None  # tried once, then shm stays off for this context
    assert _count("omnistage_transport_fallbacks_total", reason="shm_unavailable") == before + 1
