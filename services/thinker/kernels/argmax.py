"""Greedy argmax of a few logit rows: the decode step's greedy sampling, many programs a row.

torch.argmax reduces a row in one CTA (~8 us over Ling's 157,184 fp32 logits on an H200), and it
runs between two decode graph replays, on the step's critical path. Here each program reduces a
chunk of the row to one packed int64 key and the row's programs meet in an atomic max on the row's
slot; the last of them (tickets.py) writes the id into the caller's `out` (the sampled feed's
buffer: nothing to copy after) and leaves slot and ticket ready for the next launch: one launch,
no host sync, graph-safe. The ids are torch.argmax's: the largest value with ties to the lowest
index, -0.0 equal to 0.0, and a NaN above everything (the first NaN's index).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from omnistage.services.thinker.kernels import pdl, runs_triton
from omnistage.services.thinker.kernels.pdl import wait_for_prior_kernels
from omnistage.services.thinker.kernels.tickets import last_to_finish, tickets_for

# Past a few rows torch's CTA a row already fills the SMs, and this launch's rows x chunks would
# re-read as much for no gain: torch.argmax there.
MAX_ROWS = 16
BLOCK = 2048  # a program's chunk: Ling's row in 77 programs
DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # exact in fp32, where the keys are made
_LOW = tl.constexpr(2**31 - 1)  # a key's low half is _LOW - index: the lower index the larger
_EMPTY = tl.constexpr(-(2**63))  # a slot between launches, below every key
_slots: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _key(x, index):
    """fp32 x at column `index` as an int64 whose max is torch.argmax's pick: the float's bits made
    order-preserving as a signed int (-0.0 as 0.0, every NaN above +inf) over _LOW - index."""
    bits = x.to(tl.int32, bitcast=True)
    magnitude = bits & 0x7FFFFFFF
    bits = tl.where(magnitude == 0, 0, bits ^ ((bits >> 31) & 0x7FFFFFFF))
    bits = tl.where(magnitude > 0x7F800000, 0x7FFFFFFF, bits)
    return (bits.to(tl.int64) << 32) | (-index.to(tl.int64) + _LOW)


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, slots_ptr, tickets_ptr, n, stride_x, BLOCK: tl.constexpr, USE_PDL: tl.constexpr
):
    """Program (chunk, row): the chunk's best key into the row's slot; the row's last program
    takes the slot's key (resetting it) and stores its index."""
    wait_for_prior_kernels(USE_PDL)
    chunk = tl.program_id(0)
    row = tl.program_id(1)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    inside = cols < n
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=inside, other=0.0)
    keys = tl.where(inside, _key(x.to(tl.float32), cols), _EMPTY)
    tl.atomic_max(slots_ptr + row, tl.max(keys, axis=0), sem="acq_rel", scope="gpu")
    if last_to_finish(tickets_ptr, row, tl.num_programs(0)):
        best = tl.atomic_xchg(slots_ptr + row, _EMPTY, sem="acq_rel", scope="gpu")
        tl.store(out_ptr + row, (-best.to(tl.int32) + _LOW).to(tl.int64))


def supported(rows: torch.Tensor, out: torch.Tensor | None = None) -> bool:
    """Whether `argmax` takes these rows [R, V] (and `out`): where Triton runs, 1 <= R <= MAX_ROWS,
    a float dtype of DTYPES, unit column stride; `out` an int64 [R] of the same device, contiguous."""
    fits = (
        rows.dim() == 2
        and 1 <= rows.shape[0] <= MAX_ROWS
        and 1 <= rows.shape[1] <= 2**30  # int32 columns, a key's low half
        and rows.dtype in DTYPES
        and rows.stride(1) == 1
    )
    takes_out = out is None or (
        out.dtype == torch.int64
        and out.shape == rows.shape[:1]
        and out.is_contiguous()
        and out.device == rows.device
    )
    return fits and takes_out and runs_triton(rows.device)


def _slots_for(device: torch.device) -> torch.Tensor:
    """The device's MAX_ROWS row slots, empty between launches (each launch leaves them so)."""
    slots = _slots.get(device)
    if slots is None:
        slots = _slots[device] = torch.full((MAX_ROWS,), -(2**63), dtype=torch.int64, device=device)
    return slots


def argmax(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.argmax(rows, dim=-1) into `out` (made when None) by one launch; `supported` rows."""
    assert supported(rows, out), "argmax: rows (or out) this launch does not take"
    r, n = rows.shape
    if out is None:
        out = torch.empty(r, dtype=torch.int64, device=rows.device)
    grid = (triton.cdiv(n, BLOCK), r)
    slots, tickets = _slots_for(rows.device), tickets_for(rows.device, r)
    _argmax_kernel[grid](rows, out, slots, tickets, n, rows.stride(0), BLOCK, **pdl.launch(rows.device))
    return out
