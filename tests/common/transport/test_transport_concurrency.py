"""Several producer processes (two threads each) and consumer threads share small pools under pressure."""

import queue
import threading

import torch
from omnistage.common.transport import TransportContext, decode
from omnistage.v1 import tensor_pb2

from tests.common.transport.producers import Producer, encoded

PROCS, PER_THREAD, DEADLINE_S = 2, 30, 120


def _reader(producer: Producer, items: queue.Queue) -> None:
    while True:
        message = producer.said(DEADLINE_S)
        if message in ("done", ""):
            break
        tag, raw = message
        items.put((tag, tensor_pb2.TensorRef.FromString(raw)))


def test_producers_and_consumers_exchange_correct_tensors():
    procs = [Producer("tensors", p, PER_THREAD) for p in range(PROCS)]
    items: queue.Queue = queue.Queue()
    seen, errors, paths = {}, [], []
    lock = threading.Lock()
    try:
        with TransportContext() as consumer:
            readers = [threading.Thread(target=_reader, args=(p, items), daemon=True) for p in procs]

            def decoder():
                while True:
                    try:
                        item = items.get(timeout=DEADLINE_S)
                    except queue.Empty:
                        errors.append(f"no tensor from the producers within {DEADLINE_S} s")
                        return
                    if item is None:
                        return
                    tag, ref = item
                    try:
                        y = decode(ref, transport=consumer)
                        ok = torch.equal(y, encoded(tag))
                    except Exception as e:  # reported below with the tag
                        errors.append(f"{tag}: {e!r}")
                        continue
                    with lock:
                        seen[tag] = ok
                        paths.append(ref.WhichOneof("payload"))

            decoders = [threading.Thread(target=decoder) for _ in range(2)]
            for t in readers + decoders:
                t.start()
            for t in readers:
                t.join(timeout=DEADLINE_S)
                assert not t.is_alive(), f"producer output not finished within {DEADLINE_S} s"
            for _ in decoders:
                items.put(None)
            for t in decoders:
                t.join(timeout=DEADLINE_S)
                assert not t.is_alive(), f"decoder not finished within {DEADLINE_S} s"
    finally:
        for p in procs:
            p.tell()
            if p.wait() is None:
                p.stop()
    assert errors == []
    expected = {p * 10000 + t * 1000 + i for p in range(PROCS) for t in range(2) for i in range(PER_THREAD)}
    assert set(seen) == expected and all(seen.values())
    # each pool holds 4 slices at a time: more shm refs than that means slices were released and reused
    assert paths.count("shm") > 4 * PROCS
    assert [p.proc.exitcode for p in procs] == [0] * PROCS
