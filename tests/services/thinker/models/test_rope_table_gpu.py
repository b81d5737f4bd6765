"""On a GPU (skipped without CUDA): the rope table's launch (kernels/rope_table.py) gives the
computed rope's bits on the device, is the step's one kernel for its cos/sin, and replays from a
CUDA graph with each replay's staged positions. Here, not in kernels/, whose conftest runs Triton
in its interpreter."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)


def _ropes(rope_type: str, max_len: int) -> tuple[RotaryEmbedding, RotaryEmbedding]:
    """(bounded by max_len: the table's launch, unbounded: the angles computed on the device)."""
    table, computed = RotaryEmbedding(128, 64, 2.4e6, rope_type), RotaryEmbedding(128, 64, 2.4e6, rope_type)
    table.bound_positions(max_len)
    return table, computed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type", ["default", "video_rope"])
def test_the_launch_gives_the_computed_bits_on_the_device(rope_type, dtype):
    table, computed = _ropes(rope_type, 4096)
    lo, hi = table.span
    every = torch.arange(lo, hi, device=CUDA).expand(3, -1)
    drawn = torch.randint(lo, hi, (3, 37), device=CUDA, generator=torch.Generator(CUDA).manual_seed(0))
    for pos in (every, drawn, drawn[:, :1]):
        for got, want in zip(table.cos_sin(pos, dtype), computed.cos_sin(pos, dtype), strict=True):
            assert torch.equal(got, want)


def test_a_steps_cos_sin_is_one_kernel():
    table, _ = _ropes("video_rope", 4096)
    pos = torch.tensor([[7], [3], [5]], device=CUDA)
    table.cos_sin(pos, torch.bfloat16)  # the table, made once
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        table.cos_sin(pos, torch.bfloat16)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 1 and "_rope_gather_kernel" in kernels[0], kernels


def test_a_graph_replays_the_gather_with_the_staged_positions():
    table, computed = _ropes("video_rope", 4096)
    staged = torch.zeros(3, 4, dtype=torch.long, device=CUDA)
    table.cos_sin(staged, torch.bfloat16)  # the eager run before a capture makes the table
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cos, sin = table.cos_sin(staged, torch.bfloat16)
    for step in range(3):
        # The span's last rows (8189 + 2 = 8191, its end 2 · 4096 exclusive) and first (-2048) at every step.
        staged.copy_(torch.tensor([[9, 10, 11, 12], [-40, 0, 3, 8189], [5, 6, -2048, 100]]) + step)
        graph.replay()
        want_cos, want_sin = computed.cos_sin(staged, torch.bfloat16)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


def test_a_table_first_made_inside_a_capture_is_refused():
    table, _ = _ropes("default", 64)
    staged = torch.zeros(1, 2, dtype=torch.long, device=CUDA)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"), torch.cuda.graph(graph):
        table.cos_sin(staged, torch.bfloat16)
