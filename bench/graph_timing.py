"""µs a call of GPU work without its launch cost: the calls captured in one CUDA graph, replayed,
timed with CUDA events (the kernel benches: bench/gemv_gpu.py, bench/moe_decode_gpu.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def graph_time_us(fns: list[Callable[[], object]], replays: int = 10) -> float:
    """Each of `fns` run once eagerly (compile, lazily made buffers, cuBLAS's choice) and once on
    the capture stream, then all captured in order in one graph; µs a call over `replays` replays."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for fn in fns:
            fn()
        with torch.cuda.graph(graph, stream=stream):
            for fn in fns:
                fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (replays * len(fns))
