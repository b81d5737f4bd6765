"""Several producer processes (two threads each) and consumer threads share small pools under pressure."""

import base64
import queue
import subprocess
import sys
import threading

import torch
from omnistage.common.transport import TransportContext, decode
from omnistage.v1 import tensor_pb2

PRODUCER = r"""
import base64, sys, threading, torch
from omnistage.common.transport import TransportContext, TransportOptions, encode
proc_tag, per_thread = int(sys.argv[1]), int(sys.argv[2])
opts = TransportOptions(shm_pool_bytes=1 << 20, shm_threshold_bytes=1024, alloc_wait_s=0.5, max_leases=16)
ctx = TransportContext(opts)
out = threading.Lock()
def run(thread):
    for i in range(per_thread):
        tag = proc_tag * 10000 + thread * 1000 + i
        ref = encode(torch.arange(64 << 10, dtype=torch.float32) + tag, transport=ctx)  # 256 KiB
        with out:
            print(tag, base64.b64encode(ref.SerializeToString()).decode(), flush=True)
threads = [threading.Thread(target=run, args=(t,)) for t in range(2)]
for t in threads: t.start()
for t in threads: t.join()
print("done", flush=True)
sys.stdin.readline()  # keep the pool until the consumer has read every slice
ctx.close()
"""
PROCS, PER_THREAD, DEADLINE_S = 2, 30, 120


def _reader(proc, items):
    for line in proc.stdout:
        if line.strip() == "done":
            break
        tag, b64 = line.split()
        items.put((int(tag), tensor_pb2.TensorRef.FromString(base64.b64decode(b64))))


def test_producers_and_consumers_exchange_correct_tensors():
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PRODUCER, str(p), str(PER_THREAD)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for p in range(PROCS)
    ]
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
                        ok = torch.equal(y, torch.arange(64 << 10, dtype=torch.float32) + tag)
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
            try:
                p.communicate("\n", timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=60)
    assert errors == []
    expected = {p * 10000 + t * 1000 + i for p in range(PROCS) for t in range(2) for i in range(PER_THREAD)}
    assert set(seen) == expected and all(seen.values())
    # each pool holds 4 slices at a time: more shm refs than that means slices were released and reused
    assert paths.count("shm") > 4 * PROCS
    assert [p.returncode for p in procs] == [0] * PROCS
