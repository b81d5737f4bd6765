"""Throughput of tensor transport: encode+decode in one process, and a real gRPC unary hop on loopback.

For each size and path (inline, shm; cuda_ipc for GPU tensors) it reports the median over `--repeat`
runs. The gRPC hop sends the TensorRef to a server process that decodes it (copying out and releasing
the lease) and answers with an empty ref, so the time covers encode, serialisation, the hop, decode and
release.

    python load_tests/transport_bench.py --sizes 1KiB,1MiB,256MiB --repeat 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from concurrent import futures

import grpc
import torch
from omnistage.common.transport import TransportContext, TransportOptions, decode, encode
from omnistage.v1 import tensor_pb2

METHOD = "/omnistage.bench.TransportBench/Hop"
MAX_MESSAGE = 1 << 30
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE),
    ("grpc.max_receive_message_length", MAX_MESSAGE),
]
_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "b": 1}
DEFAULT_SIZES = "1KiB,16KiB,64KiB,256KiB,1MiB,4MiB,16MiB,64MiB,256MiB"


def parse_size(text: str) -> int:
    t = text.strip().lower()
    for unit, scale in _UNITS.items():
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * scale)
    return int(t)


def human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def _options(max_bytes: int) -> TransportOptions:
    pool = max(2 * max_bytes, 1 << 20)
    return TransportOptions(shm_pool_bytes=pool, cuda_pool_bytes=pool, alloc_wait_s=1.0)


def serve(max_bytes: int) -> None:
    """Server process: decode every TensorRef it gets; print the port, then serve until stdin closes."""
    ctx = TransportContext(_options(max_bytes))

    def hop(ref: tensor_pb2.TensorRef, _context: grpc.ServicerContext) -> tensor_pb2.TensorRef:
        y = decode(ref, transport=ctx)
        return tensor_pb2.TensorRef(dtype=ref.dtype, shape=[y.numel()])

    handler = grpc.method_handlers_generic_handler(
        "omnistage.bench.TransportBench",
        {
            "Hop": grpc.unary_unary_rpc_method_handler(
                hop,
                request_deserializer=tensor_pb2.TensorRef.FromString,
                response_serializer=tensor_pb2.TensorRef.SerializeToString,
            )
        },
    )
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    sys.stdin.read()
    server.stop(grace=5).wait(timeout=10)
    ctx.close()


def _median_s(fn, repeat: int) -> float:
    fn()  # warm-up: pools created, mappings cached, channel connected
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(sizes: list[int], repeat: int, paths: list[str], grpc_hop: bool) -> list[dict]:
    producer = TransportContext(_options(max(sizes)))
    consumer = TransportContext(_options(max(sizes)))
    server = stub = None
    if grpc_hop:
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", str(max(sizes))],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        port = int(server.stdout.readline() or 0)
        if not port:
            raise RuntimeError("bench gRPC server did not report its port")
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
        grpc.channel_ready_future(channel).result(timeout=30)
        stub = channel.unary_unary(
            METHOD,
            request_serializer=tensor_pb2.TensorRef.SerializeToString,
            response_deserializer=tensor_pb2.TensorRef.FromString,
        )
    rows = []
    try:
        for size in sizes:
            x = torch.randint(0, 255, (size,), dtype=torch.uint8)
            for path in paths:
                x = x.cuda() if path == "cuda_ipc" else x.cpu()
                ref = encode(x, transport=producer, force=path)
                taken = ref.WhichOneof("payload")
                decode(ref, transport=consumer)
                local = _median_s(
                    lambda x=x, path=path: decode(
                        encode(x, transport=producer, force=path), transport=consumer
                    ),
                    repeat,
                )
                hop = None
                if stub is not None:
                    hop = _median_s(
                        lambda x=x, path=path: stub(encode(x, transport=producer, force=path), timeout=120),
                        repeat,
                    )
                rows.append({"size": size, "path": path, "taken": taken, "local_s": local, "grpc_s": hop})
                producer.reclaim_expired()
    finally:
        if server is not None:
            server.stdin.close()
            server.wait(timeout=30)
        producer.close()
        consumer.close()
    return rows


def table(rows: list[dict]) -> str:
    def cell(seconds: float | None, size: int) -> str:
        if seconds is None:
            return "-"
        return f"{seconds * 1e3:.3f} ms, {size / seconds / 1e9:.2f} GB/s"

    lines = ["| size | path | encode+decode in process | gRPC unary hop (loopback) |", "|---:|---|---:|---:|"]
    for r in rows:
        went = {"inline_data": "inline", "shm": "shm", "cuda": "cuda_ipc"}[r["taken"]]
        path = r["path"] if went == r["path"] else f"{r['path']} (went {went})"
        lines.append(
            f"| {human(r['size'])} | {path} | {cell(r['local_s'], r['size'])} | {cell(r['grpc_s'], r['size'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list, e.g. 1KiB,4MiB,256MiB")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--paths", default="inline,shm", help="inline,shm,cuda_ipc (cuda_ipc sends GPU tensors)")
    ap.add_argument("--no-grpc", action="store_true", help="skip the gRPC hop")
    ap.add_argument("--serve", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve is not None:
        serve(args.serve)
        return
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    rows = run(sizes, args.repeat, args.paths.split(","), not args.no_grpc)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, repeat {args.repeat} (median)\n")
    print(table(rows))


if __name__ == "__main__":
    main()
