"""Ticket counters for a launch whose programs share one result: each program of a group takes a
ticket when its part is stored, and the one that takes the last finishes the group (the router's
split logits, the split decode attention's partials, the greedy argmax's chunks). No second launch,
graph-safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Groups of a decode launch stay below this: the router's token blocks (at most 256 tokens), the
# split attention's (sequence, KV head) pairs (fewer than paged_attention.SPLIT_TARGET_PROGRAMS),
# the greedy argmax's rows (argmax.MAX_ROWS).
MIN_TICKETS = 1024

_tickets: dict[torch.device, torch.Tensor] = {}


def tickets_for(device: torch.device, groups: int) -> torch.Tensor:
    """The zeroed ticket counters of `device` (each launch leaves them zero; launches on one stream
    run one after another, so every kernel can use the same buffer); made once, outside any graph
    capture in practice (the eager warm-up forward runs first), at MIN_TICKETS at least so that no
    decode batch grows it (a captured graph keeps the buffer it was captured with)."""
    buf = _tickets.get(device)
    if buf is None or buf.numel() < groups:
        buf = _tickets[device] = torch.zeros(max(groups, MIN_TICKETS), dtype=torch.int32, device=device)
    return buf


@triton.jit
def last_to_finish(tickets_ptr, group, programs):
    """Whether this program took group `group`'s last ticket of `programs` (after a CTA barrier, so
    every thread's stores are done before the ticket releases them); that program resets the
    ticket, so the buffer is zero again for the next launch."""
    tl.debug_barrier()
    done = tl.atomic_add(tickets_ptr + group, 1, sem="acq_rel", scope="gpu")
    last = done == programs - 1
    if last:
        tl.store(tickets_ptr + group, 0)
    return last
