"""A decode step's inputs on the device: ids, positions, cache slots, context lengths and block tables,
written into a pinned host array and sent in one copy.

Copied on the compute stream, that copy runs after the step before it has finished — its reads of
the same buffer must end first — so a one-sequence step waited ~5 µs for it on an H200 (the step's
critical path, bench/RESULTS.md session 9). With two device buffers used in turn, the copy of step N+1
waits only for step N−1 (the last reader of its buffer) on a copy stream of its own, and runs while
step N computes; the compute stream waits for it before the step (free when it is done). The decode
graphs then capture a graph per buffer (`DecodeGraphs`: at the small batches, where the copy is a
share of the step worth a graph more).
"""

from __future__ import annotations

import torch


class DecodeStaging:
    """`buffers` device buffers of `layout` int64 rows (ids, positions, slots, context lens, tables)
    and two pinned host arrays, each step's plan written into the next host array and copied into the
    buffer it names."""

    def __init__(self, layout: tuple[int, ...], device: torch.device, buffers: int = 1) -> None:
        if buffers not in (1, 2):
            raise ValueError(f"decode staging: 1 or 2 device buffers (got {buffers})")
        self.layout, self.device = layout, device
        total = sum(layout)
        cuda = device.type == "cuda"
        # Two host arrays used in turn: a step is staged while the copy of the one before may still
        # wait in the device's queue (async scheduling), so that array is left alone.
        self.hosts = [torch.zeros(total, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.turn = 0
        self.buffers = [torch.zeros(total, dtype=torch.int64, device=device) for _ in range(buffers)]
        self.copy_stream = torch.cuda.Stream(device) if cuda and buffers > 1 else None
        # Made once, recorded again each step (a wait or synchronize reads the latest record): each
        # host array's last copy, and each buffer's last reader (a step on the compute stream).
        self.copied = [torch.cuda.Event() for _ in range(2)] if cuda else []
        self.released = [torch.cuda.Event() for _ in range(buffers)] if self.copy_stream else []
        self._recorded: set[tuple[str, int]] = set()  # the events recorded at least once

    def next_host(self) -> torch.Tensor:
        """The host array whose last copy has left it (it waits for that copy, which precedes the step
        before the one running now: in practice long done)."""
        self.turn ^= 1
        if ("copied", self.turn) in self._recorded:
            self.copied[self.turn].synchronize()
        return self.hosts[self.turn]

    def copy_in(self, host: torch.Tensor, buffer: int, blocking: bool = False) -> None:
        """`host` into device buffer `buffer`, ordered before what the compute stream queues next. On
        the copy stream (two buffers) after the buffer's last reader, else on the compute stream."""
        dest = self.buffers[buffer]
        if self.copy_stream is None:
            dest.copy_(host, non_blocking=not blocking)
            self._record("copied", self.turn, torch.cuda.current_stream(self.device) if self.copied else None)
            return
        if ("released", buffer) in self._recorded:
            self.copy_stream.wait_event(self.released[buffer])
        with torch.cuda.stream(self.copy_stream):
            dest.copy_(host, non_blocking=not blocking)
        self._record("copied", self.turn, self.copy_stream)
        torch.cuda.current_stream(self.device).wait_event(self.copied[self.turn])

    def release(self, buffer: int) -> None:
        """The step queued last on the compute stream is `buffer`'s last reader (its next copy waits)."""
        if self.copy_stream is not None:
            self._record("released", buffer, torch.cuda.current_stream(self.device))

    def views(self, flat: torch.Tensor, max_batch: int, width: int) -> tuple[torch.Tensor, ...]:
        """(ids, positions [3, n], slots, context lens, tables [n, width]) of a host array or buffer."""
        ids, pos, slots, ctx, tables = torch.split(flat, self.layout)
        return ids, pos.view(3, max_batch), slots, ctx, tables.view(max_batch, width)

    def _record(self, kind: str, index: int, stream: torch.cuda.Stream | None) -> None:
        """Record event `kind` `index` ("copied": a host array's, "released": a buffer's) on `stream`
        (none on a CPU: nothing to wait for)."""
        if stream is None:
            return
        (self.copied if kind == "copied" else self.released)[index].record(stream)
        self._recorded.add((kind, index))
