"""Programmatic dependent launch (PDL, sm_90 and later) for the decode step's Triton kernels.

A decode step is a chain of ~200 small kernels (Ling-mini, one sequence); without PDL each is
launched by the GPU only after the one before has drained. With PDL the next kernel is launched
while the current one runs and waits on the device (`griddepcontrol.wait`) before it touches
memory. Every kernel launched so calls `wait_for_prior_kernels` as its first statement: every
prior kernel has completed and its writes are visible before any load or store, so no
read-after-write or write-after-read race is possible whatever the kernel does after it (a
kernel launched without PDL, e.g. cuBLAS, keeps the ordinary stream order). The exceptions: a
kernel may load its static operands (`STATIC_OPERANDS`: weights no kernel writes) and its settled
ones (`SETTLED_OPERANDS`: what the launch two or more back wrote) before the wait, so that those HBM reads
overlap the previous kernel, and where a flag announces them (`FLAGGED_OPERANDS`, `ready_flag.py`)
operands the running kernel before it wrote (tests/services/thinker/kernels/test_pdl.py checks the
rules).
`OMNISTAGE_THINKER_PDL=off` turns it off (the same build's comparison, `bench/ling_mini_gpu.py
--pdl`); off on a CPU, under Triton's interpreter, and before Hopper.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without the intrinsics: never launched with PDL (`_supported`)

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


PDL_ENV = "OMNISTAGE_THINKER_PDL"

# kernel name → the pointer parameters it may load from before `wait_for_prior_kernels`: operands
# that no kernel ever writes (a layer's weights and biases, written once at load, before any step).
# Before its wait such a kernel has only assignments (or `if` on constexprs holding them) that name
# no other pointer parameter (a pointer parameter's name ends in `_ptr`, as every kernel's here
# does) and these only as the pointer a `tl.load` reads: no store, no atomic, no helper given a
# pointer. A kernel not named here waits first (tests/services/thinker/kernels/test_pdl.py walks
# every PDL kernel's syntax tree for both rules). The launch must pass these parameters the
# weights themselves whatever the path, never a copy made for it (router.py `_operands`: the gate
# weight as given, even where unread).
STATIC_OPERANDS: dict[str, tuple[str, ...]] = {
    "_route_kernel": ("w_ptr", "bias_ptr", "norm_w_ptr"),  # the gate's, and the folded norm's weight
    "_resident_gemv_kernel": ("w_ptr", "norm_w_ptr"),
    # its first tile of the dense MLP's gate and up rows, and the folded post-attention norm's weight
    "_dense_gate_up_kernel": ("w_ptr", "norm_w_ptr"),
    "_one_token_down_kernel": ("w2_ptr", "shared_ptr"),
    "_one_token_gate_up_stream_kernel": ("bias_ptr",),  # the router's expert bias, where it selects
}
# kernel name → the pointer parameters it may load from before its wait because a launch two or more
# back wrote them (or a node before the step's first kernel): the kernel right before it waited for that launch to complete before it let this one
# start (its `wait_for_prior_kernels` comes before its trigger). The caller launches them in that
# order. The same syntax rule as STATIC_OPERANDS.
SETTLED_OPERANDS: dict[str, tuple[str, ...]] = {
    "_one_token_down_kernel": ("ids_ptr", "weights_ptr"),  # the router's, before the gate-up launch
    # The step's lengths, block tables and slots (staged before its first kernel) and the KV cache
    # rows of earlier steps: the kernel masks off the row this step writes (the context's last)
    # and reads it after its wait.
    "_decode_kernel": ("ctx_ptr", "tables_ptr", "slots_ptr", "k_cache_ptr", "v_cache_ptr"),
}
# kernel name → (a bool constexpr parameter, some of its SETTLED_OPERANDS): those are settled only in
# the variant launched with the constexpr True; launched with it False the launch right before wrote
# them, so the kernel reads them after its wait (test_pdl.py checks each variant's pre-wait reads).
SETTLED_WHEN: dict[str, tuple[str, tuple[str, ...]]] = {
    # IDS_SETTLED=False: the streaming gate-up selected and stored them (moe_one_token.selecting_experts).
    "_one_token_down_kernel": ("IDS_SETTLED", ("ids_ptr", "weights_ptr"))
}
# kernel name → (its flag pointer parameter, the pointer parameters the flag announces): the one
# exception to the rule that reads what a still-running kernel writes. Before its wait such a kernel
# may call `ready_flag.poll_flag(<the flag>, ...)` (a bounded poll, then one atomic: its ticket),
# its result assigned by a plain assignment, and after that load from these operands, each load
# masked by the poll's result (its first name, or a name computed from it): the launch before
# stores them, then raises the flag with release semantics (`ready_flag.raise_flag`), so a program
# that saw it reads them complete. It reads them again after its wait and keeps what it loaded
# early only where they are unchanged (correctness never rests on the flag; ready_flag.py says
# why no bit changes and why the word is zero after every launch). No other atomic or store, and
# the flag in nothing but the poll, before the wait (tests/services/thinker/kernels/test_pdl.py).
FLAGGED_OPERANDS: dict[str, tuple[str, tuple[str, ...]]] = {
    # IDS_FLAGGED: the selecting gate-up's program 0 raises the flag after storing the ids.
    "_one_token_down_kernel": ("flag_ptr", ("ids_ptr",))
}


def requested() -> bool:
    """PDL_ENV's choice (default on); anything but on / off is refused, naming both."""
    value = os.environ.get(PDL_ENV, "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"{PDL_ENV}={value!r}: expected on or off")
    return value == "on"


def _supported() -> bool:
    if os.environ.get("TRITON_INTERPRET") == "1" or not requested():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait as _  # noqa: F401
    except ImportError:
        return False
    return "launch_pdl" in CUDAOptions.__dataclass_fields__


@functools.cache
def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with PDL."""
    if device.type != "cuda" or not torch.cuda.is_available() or not _supported():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def launch(device: torch.device) -> dict:
    """The launch arguments of a kernel with a `USE_PDL` constexpr, for a launch on `device`."""
    return {"USE_PDL": True, "launch_pdl": True} if enabled(device) else {"USE_PDL": False}


@triton.jit
def wait_for_prior_kernels(USE_PDL: tl.constexpr):
    """First statement of a kernel launched by `launch` (after only the loads of its
    STATIC_OPERANDS): wait until every prior kernel completed (its writes visible), then let the
    next kernel launch (it waits the same way)."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
