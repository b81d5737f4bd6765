"""A kernel argument that changes from step to step is never specialised on.

Triton compiles a new variant when an int argument changes class (== 1, divisible by 16, other). An
argument that follows the step's size (pair and token counts, the block-table width) would compile a
variant at first use for a size the warm-up did not happen to have: on one H200 the expert GEMMs
compiled again at c=64 (an odd-sized prefill step's pairs) after a warm-up of power-of-two prompts."""

from __future__ import annotations

import pytest
from omnistage.services.thinker.kernels import (
    embed_gather,
    fused_moe,
    moe_align,
    paged_attention,
    paged_prefill,
    rope_table,
    router,
)

# kernel → the arguments a step's size sets (everything else is fixed by the model's shapes).
PER_STEP = {
    fused_moe._expert_gemm_kernel: {"num_pairs"},
    moe_align._count_kernel: {"num_pairs"},
    moe_align._runs_kernel: {"num_pairs", "shared_rows"},
    moe_align._align_one_program_kernel: {"num_pairs", "shared_rows"},
    router._route_kernel: {"num_tokens"},
    paged_prefill._prefill_kernel: {"stride_tb"},
    paged_attention._decode_kernel: {"stride_tb"},
    rope_table._rope_gather_kernel: {"num_tokens", "stride_axis"},  # [3, T] staged rows: stride T
    embed_gather._embed_gather_kernel: {"feed_len"},  # an eager step's sampled ids: its sampled rows
}


def _unspecialised(kernel) -> set[str]:
    """The kernel's do_not_specialize by name (a JITFunction, or the interpreter's wrapper of one)."""
    listed = kernel.kwargs["do_not_specialize"] if hasattr(kernel, "kwargs") else kernel.do_not_specialize
    return {kernel.arg_names[i] if isinstance(i, int) else i for i in listed or ()}


@pytest.mark.parametrize("kernel", list(PER_STEP), ids=lambda k: k.__name__)
def test_a_steps_sizes_are_never_specialised(kernel):
    assert set(kernel.arg_names) >= PER_STEP[kernel], "an argument was renamed: update PER_STEP"
    assert PER_STEP[kernel] <= _unspecialised(kernel)
