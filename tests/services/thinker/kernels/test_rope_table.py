"""The rope table's gather launch (kernels/rope_table.py) under the interpreter: the torch gather's
bits (`rotary.gather_reference`, itself the computed rope's: tests/services/thinker/models/
test_thinker_rotary.py) for every layout of positions a step passes, in one launch."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels import rope_table
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding, gather_reference

CPU = torch.device("cpu")


def _rope(rope_type: str, max_len: int = 200) -> RotaryEmbedding:
    rope = RotaryEmbedding(128, 64, 2.4e6, rope_type)
    rope.bound_positions(max_len)
    return rope


def _layouts(lo: int, hi: int, tokens: int) -> dict[str, torch.Tensor]:
    """The step's positions as the forward gets them: [3, T] staged rows (a graph's slice of a wider
    buffer too), one row expanded to three, and a single row."""
    g = torch.Generator().manual_seed(tokens)
    staged = torch.randint(lo, hi, (3, tokens + 5), generator=g)
    staged[:, 0], staged[:, -1] = torch.tensor([lo, hi - 1, hi - 2]), hi - 1
    return {
        "staged": staged[:, :tokens],
        "expanded": staged[0, -tokens:].expand(3, -1),
        "one_row": staged[1:2, -tokens:],
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope_type", ["default", "video_rope"])
@pytest.mark.parametrize("tokens", [1, 16, 17])
def test_the_launch_gives_the_torch_gathers_bits(launches, rope_type, dtype, tokens):
    launches.watch(rope_table, "_rope_gather_kernel")
    rope = _rope(rope_type)
    table, (_, columns) = rope.table(CPU, dtype), rope._axes_index(CPU)
    for name, pos in _layouts(*rope.span, tokens).items():
        if rope_type == "video_rope" and name == "one_row":
            continue  # 3D rope takes three axes
        cos, sin = rope_table.gather(table.rows, table.lo, pos, columns)
        want_cos, want_sin = gather_reference(table, pos, columns)
        assert cos.dtype == dtype and cos.shape == sin.shape == (tokens, 64), name
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin), name
    layouts = 3 if rope_type == "default" else 2
    assert launches.of("_rope_gather_kernel") == [((-(-tokens // rope_table.BLOCK_T),), 64)] * layouts


def test_a_position_past_the_table_is_clamped_and_no_tokens_launch_nothing(launches):
    launches.watch(rope_table, "_rope_gather_kernel")
    rope = _rope("video_rope", 10)  # rows of positions -5 .. 19
    table, (_, columns) = rope.table(CPU, torch.float32), rope._axes_index(CPU)
    pos = torch.tensor([[-9, 25, 3], [30, -6, 3], [19, -5, 40]])
    cos, sin = rope_table.gather(table.rows, table.lo, pos, columns)
    clamped = pos.clamp(-5, 19)
    assert torch.equal(cos, gather_reference(table, clamped, columns)[0])
    assert torch.equal(sin, rope.computed(clamped, torch.float32)[1])
    cos, sin = rope_table.gather(table.rows, table.lo, pos[:, :0], columns)
    assert cos.shape == sin.shape == (0, 64)
    assert len(launches.of("_rope_gather_kernel")) == 1
