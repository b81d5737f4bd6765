import logging

import pytest
import torch
from omnistage.common.transport import TransportContext, TransportError, TransportOptions, encode
from omnistage.common.transport.release import release_quietly
from omnistage.v1 import tensor_pb2


def test_a_ref_nobody_will_take_gets_its_lease_back():
    with (
        TransportContext(TransportOptions(shm_pool_bytes=1 << 20)) as producer,
        TransportContext() as consumer,
    ):
        ref = encode(torch.arange(4096, dtype=torch.int64), transport=producer, force="shm")
        arena = producer.shm_pool().arena
        assert arena.active_leases == 1
        release_quietly(consumer, tensor_pb2.TensorRef.FromString(ref.SerializeToString()), "test lease")
        assert arena.reclaim() == 1 and arena.active_leases == 0


class _GoneProducer:
    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def release(self, ref: tensor_pb2.TensorRef) -> None:
        raise self.exc


@pytest.mark.parametrize(
    "exc", [TransportError("segment gone"), OSError("no such file"), ValueError("bad ref")]
)
def test_a_failed_release_is_logged_with_what_it_was_not_raised(caplog, exc):
    with caplog.at_level(logging.WARNING):
        release_quietly(_GoneProducer(exc), tensor_pb2.TensorRef(), "embedding lease")
    assert f"embedding lease not released: {exc}" in caplog.text


def test_an_unexpected_error_in_a_release_is_not_swallowed():
    with pytest.raises(KeyError):
        release_quietly(_GoneProducer(KeyError("bug")), tensor_pb2.TensorRef(), "embedding lease")
