"""An "ids ready" flag from one launch to the next one's programs before their PDL wait (issue 40).

Where the streaming gate-up selects the experts (`moe_one_token.selecting_experts`), the down launch
reads the ids one launch back, so by `pdl.wait_for_prior_kernels`' rule only after its wait: its
chosen experts' down rows (18.9 MB at Ling-mini) would no longer stream while the gate-up runs. With
the flag the gate-up's program 0 says when its ids are stored, and each down program that sees it
reads them and issues those rows' loads before its wait (`pdl.FLAGGED_OPERANDS`: the one exception
to the wait-first rule that reads what a running kernel writes).

One int32 word a device (`flag_for`): bit 0 the flag, the bits above a ticket count.

- Set (`raise_flag`, the gate-up's program 0 after storing the ids): a CTA barrier (every thread's
  store of the ids done), then an atomic OR of 1 with release semantics at gpu scope (the
  __syncthreads + release pattern; an OR, not an exchange, keeps the count of the tickets the down
  programs may already have taken).
- Poll (`poll_flag`, each down program before its wait): volatile loads of the word until bit 0 is
  set or POLLS loads were made (bounded: the flag only decides whether early loads are issued, so
  no program ever waits on it without a bound), then one atomic add of 2 (its ticket) with acquire
  semantics at gpu scope: the flag is seen when the word it returns has bit 0 set, and the ids the
  release published are then visible to the program (an acquire reading the value of a release or
  of a read-modify-write after it synchronizes with that release). The program that takes the
  launch's last ticket (count = programs - 1) is the one that resets.
- Reset (`lower_flag`, that last program AFTER its wait): stores 0 to the word (flag and count).

Why the reset cannot race a set: the gate-up launched right before sets the flag before it
completes, and the resetting program's wait returns only after that completion; the next layer's
gate-up sets it only after its own wait, i.e. after the router after this down completed, and so
after the reset. And every program of the launch polled before the last ticket was taken: no poll
of this launch reads the reset. So the word is 0 after every down launch, whether the flag was seen
or not (a poll that timed out before the set still takes its ticket; the OR then keeps the count).
Without PDL (off, before Hopper, under the interpreter) the down starts after the gate-up completed:
every program sees the flag at its first load. The compiled order (the poll, the early ids and rows
before griddepcontrol.wait; the release after the barrier) is checked by
tests/services/thinker/kernels/sm90_compile.py.

Why the flag cannot change a bit: it decides only which loads are issued before the wait. After its
wait each down program reads the ids again (the gate-up completed: they are the launch's own) and
uses a slot's early rows only where the id read before the wait equals the one read after it; any
other slot's rows are loaded then (a masked load whose masked-off lanes keep the early values).
An early id is read only where the flag was seen, and kept only inside [0, experts) (any other:
no early load), so even a stale flag (a word left 1: never, by the argument above, on one stream)
over a stale or uninitialized ids buffer costs speed, never bits, nor a read out of bounds. The
routing weights are read after the wait only (read with the ids, no longer chain).

One word a device, as `tickets.tickets_for`: launches on one stream run one after another, so every
layer's launches use the same word; made outside any graph capture in practice (the eager warm-up
forward runs first), and a captured graph keeps the buffer it was captured with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Volatile loads a down program makes before it gives up on the flag (and reads its rows after its
# wait). The flag is set a few µs after the gate-up's wait (program 0's selection, then its stores),
# and the down's programs start only after every gate-up program has passed its wait, so a handful
# of loads (~0.2-0.5 µs each from L2) suffice; the bound caps a flag never set (a misuse) at
# ~50-100 µs a program, never a hang.
POLLS = 256

_flags: dict[torch.device, torch.Tensor] = {}


def flag_for(device: torch.device) -> torch.Tensor:
    """The zeroed flag word of `device` (int32 [1]; each flagged down launch leaves it zero); `cuda`
    without an index is the current CUDA device's (one word whichever way the device is named)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    buf = _flags.get(device)
    if buf is None:
        buf = _flags[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return buf


@triton.jit
def raise_flag(flag_ptr):
    """After this program's stores of what the flag announces: a CTA barrier, then bit 0 set with
    release semantics (the stores of every thread visible to an acquire that sees it)."""
    tl.debug_barrier()
    tl.atomic_or(flag_ptr, 1, sem="release", scope="gpu")


@triton.jit
def poll_flag(flag_ptr, POLLS: tl.constexpr):
    """(seen, last): whether the flag was set within POLLS volatile loads (confirmed by an acquire:
    what the release published is visible), and whether this program took the launch's last
    ticket (it resets the word after its wait: `lower_flag`). Before the program's PDL wait, in a
    kernel of `pdl.FLAGGED_OPERANDS` only."""
    word = tl.load(flag_ptr, volatile=True)
    polls = tl.full([], 1, tl.int32)
    while ((word & 1) == 0) & (polls < POLLS):
        word = tl.load(flag_ptr, volatile=True)
        polls += 1
    old = tl.atomic_add(flag_ptr, 2, sem="acquire", scope="gpu")
    return (old & 1) != 0, (old >> 1) == tl.num_programs(0) - 1


@triton.jit
def lower_flag(flag_ptr, last):
    """After the PDL wait: the program that took the last ticket zeroes the word (flag and count)."""
    if last:
        tl.store(flag_ptr, 0)
