"""One-shot all-reduce of a small message over peer blocks (CUDA IPC), one launch.

Every rank owns one block of device memory that every other rank has mapped (`tp/peer_blocks.py`):
flags its peers write, its own call counters and error word, and two data halves. Each program of a
launch takes the same slice of the message on every rank and, with no other program's help:
copies its slice of the input into the half this call uses (calls alternate halves), announces the
call to every rank (a release store into each block's flag for this program and this rank), waits
until every rank has announced it (acquire loads of its own flags), sums the slice of every rank's
half in fp32 in rank order (so every rank gets the same bits) and writes it over the input.

No second barrier: a rank writes a half again two calls later, and by then every peer has announced
the call in between, which it does only after its previous launch (the one that read the half) has
ended. That needs every launch to have the same number of programs (`PeerLaunch.programs`): each
program counts its calls in its own counter and picks the half from it.

The wait is bounded: past the deadline (`globaltimer` on the GPU, a number of polls under the
interpreter) the program records which rank it waited for in the block's error word and in a host
word the host polls without a sync, and returns; once the error word is set, later launches wait
for no one (the group is failing: one deadline, not one per call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_WORLD = tl.constexpr(8)
MAX_PROGRAMS = tl.constexpr(32)
# Byte offsets in a rank's block: flags [MAX_PROGRAMS][MAX_WORLD] int64 (written by the ranks), the
# programs' call counters, the error word, then the two data halves.
FLAGS_OFFSET = tl.constexpr(0)
COUNTERS_OFFSET = tl.constexpr(MAX_PROGRAMS * MAX_WORLD * 8)
ERROR_OFFSET = tl.constexpr(COUNTERS_OFFSET + MAX_PROGRAMS * 8)
DATA_OFFSET = tl.constexpr(4096)
# The table's words after the blocks: the host error word's address, the wait's deadline in ns
# (GPU) and in polls (interpreter). In device memory, so a replayed graph reads the current values.
HOST_ERROR_SLOT, TIMEOUT_NS_SLOT, MAX_POLLS_SLOT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
TABLE_EXTRA = 3


def block_bytes(capacity_bytes: int) -> int:
    """Bytes of one rank's block for messages of up to `capacity_bytes`."""
    return DATA_OFFSET.value + 2 * capacity_bytes


def decode_error(word: int) -> tuple[int, int]:
    """(the call that timed out, counted from 1; the rank it waited for) from an error word."""
    return word >> 8, (word & 0xFF) - 1


@triton.jit
def _now(USE_CLOCK: tl.constexpr):
    if USE_CLOCK:
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _seen(mine, valid, call):
    """The calls the ranks have announced to this program (masked ranks: `call`)."""
    return tl.where(valid, tl.atomic_add(mine, 0, mask=valid, sem="acquire", scope="sys"), call)


@triton.jit
def _announce_and_wait(
    table_ptr, me, pid, rank, call, WORLD: tl.constexpr, WORLD_P2: tl.constexpr, USE_CLOCK: tl.constexpr
):
    """Tell every rank this program reached `call`, then wait until every rank has; False when the
    deadline passed (the error words then name the rank waited for) or the group already failed."""
    ranks = tl.arange(0, WORLD_P2)
    valid = ranks < WORLD
    bases = tl.load(table_ptr + ranks, mask=valid, other=0)
    error_ptr = (me + ERROR_OFFSET).to(tl.pointer_type(tl.int64))
    healthy = tl.load(error_ptr, volatile=True) == 0
    tl.debug_barrier()  # every thread's copy of the slice is done before the release below
    theirs = (bases + FLAGS_OFFSET + (pid * MAX_WORLD + rank) * 8).to(tl.pointer_type(tl.int64))
    tell = ranks < tl.where(healthy, WORLD, 0)  # every rank, or none once the group failed
    tl.atomic_xchg(theirs, call, mask=tell, sem="release", scope="sys")
    mine = (me + FLAGS_OFFSET + (pid * MAX_WORLD + ranks) * 8).to(tl.pointer_type(tl.int64))
    seen = _seen(mine, valid, call)
    extra = table_ptr + WORLD
    timeout_ns = tl.load(extra + TIMEOUT_NS_SLOT)
    max_polls = tl.load(extra + MAX_POLLS_SLOT)
    start = _now(USE_CLOCK)
    polls = tl.full([], 0, tl.int64)
    waiting = (tl.min(seen, axis=0) < call) & healthy
    while waiting:
        seen = _seen(mine, valid, call)
        polls += 1
        if USE_CLOCK:
            in_time = _now(USE_CLOCK) - start <= timeout_ns
        else:
            in_time = polls < max_polls
        waiting = (tl.min(seen, axis=0) < call) & in_time
    arrived = (tl.min(seen, axis=0) >= call) & healthy
    if healthy & (tl.min(seen, axis=0) < call):
        word = (call << 8) | (tl.argmin(seen, axis=0).to(tl.int64) + 1)
        if tl.atomic_cas(error_ptr, word * 0, word, sem="relaxed", scope="gpu") == 0:
            # The first program to fail tells the host (a plain store: no atomics over PCIe).
            host_ptr = tl.load(extra + HOST_ERROR_SLOT).to(tl.pointer_type(tl.int64))
            tl.store(host_ptr, word, cache_modifier=".wt")
    tl.debug_barrier()
    return arrived


@triton.jit
def _one_shot_kernel(
    x_ptr,
    table_ptr,
    n,
    rank,
    half_bytes,
    WORLD: tl.constexpr,
    WORLD_P2: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_CLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = x_ptr.dtype.element_ty
    me = tl.load(table_ptr + rank)
    counter_ptr = (me + COUNTERS_OFFSET + pid * 8).to(tl.pointer_type(tl.int64))
    call = tl.load(counter_ptr) + 1
    data = DATA_OFFSET + (call % 2) * half_bytes
    chunk = tl.cdiv(tl.cdiv(n, tl.num_programs(0)), BLOCK) * BLOCK
    lo = pid * chunk
    hi = tl.minimum(lo + chunk, n)
    own = (me + data).to(tl.pointer_type(dtype))
    for start in range(lo, hi, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        ok = offs < hi
        dst = tl.multiple_of(own + offs, 16)
        tl.store(dst, tl.load(x_ptr + offs, mask=ok), mask=ok)
    if _announce_and_wait(table_ptr, me, pid, rank, call, WORLD, WORLD_P2, USE_CLOCK):
        for start in range(lo, hi, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            ok = offs < hi
            acc = tl.zeros([BLOCK], tl.float32)
            for r in tl.static_range(WORLD):
                theirs = (tl.load(table_ptr + r) + data).to(tl.pointer_type(dtype))
                src = tl.multiple_of(theirs + offs, 16)
                acc += tl.load(src, mask=ok, other=0.0, cache_modifier=".cg").to(tl.float32)
            tl.store(x_ptr + offs, acc.to(dtype), mask=ok)
    tl.store(counter_ptr, call)


@dataclass(frozen=True)
class PeerLaunch:
    """How a rank launches the kernel: the same on every rank of the group (the programs' counters
    must stay in step), for the life of its blocks."""

    world: int
    rank: int
    capacity_bytes: int
    programs: int = 16
    block: int = 1024

    def __post_init__(self) -> None:
        if not 2 <= self.world <= MAX_WORLD.value or not 0 <= self.rank < self.world:
            raise ValueError(
                f"peer all-reduce: rank {self.rank} of {self.world} (2..{MAX_WORLD.value} ranks)"
            )
        if self.capacity_bytes <= 0 or self.capacity_bytes % 256:
            raise ValueError(f"peer all-reduce: capacity {self.capacity_bytes} bytes (a multiple of 256)")
        if not 1 <= self.programs <= MAX_PROGRAMS.value:
            raise ValueError(f"peer all-reduce: {self.programs} programs (1..{MAX_PROGRAMS.value})")


def one_shot_all_reduce(x: torch.Tensor, table: torch.Tensor, launch: PeerLaunch) -> torch.Tensor:
    """Sum `x` (contiguous, at most `launch.capacity_bytes`) over the ranks in place and return it.
    `table` (int64, on x's device): every rank's block as mapped here, then TABLE_EXTRA words."""
    _one_shot_kernel[(launch.programs,)](
        x,
        table,
        x.numel(),
        launch.rank,
        launch.capacity_bytes,
        WORLD=launch.world,
        WORLD_P2=triton.next_power_of_2(launch.world),
        BLOCK=launch.block,
        USE_CLOCK=x.device.type == "cuda",
    )
    return x
