"""3D "video_rope" position ids of one prompt (ming.md §2.3, `get_t_scale_rope_index` semantics).

Text advances all three axes together. A vision block (`<image>` then its patch tokens) with merged
grid (T, H', W') starting at p puts temporal index p + scale·i on frame i and centres the spatial
axes on it: h = t + r − ⌊(H'−1)/2⌋, w = t + c − ⌊(W'−1)/2⌋. The next text starts at the largest
temporal index + 1, and decode positions are `cache_position + rope_delta` on all axes. Every
position of a sequence of at most L tokens lies in `position_span(L)` (the rope's table,
models/layers/rotary.py): `get_rope_index` checks its own result against it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Grid = Sequence[int]  # (t, h, w) in patch units, before the spatial merge


def position_span(max_len: int) -> tuple[int, int]:
    """[lo, hi): every video_rope position of a sequence of at most `max_len` tokens, its prompt's
    (`get_rope_index`) and its decode tokens' (index + rope_delta, index < max_len).

    Why, for a prompt of n <= max_len tokens (scale 2): a vision block starts at p >= 1 (its
    `<image>` is text before it) and centres its spatial axes at most ⌊(H'−1)/2⌋ <= ⌊(n−2)/2⌋ below
    its temporal index, so no position is below −(n // 2). Text moves the next position by 1 a
    token, a block of T·H'·W' tokens by 2T − 1 < 2·T·H'·W', and in a block frame f, row r, column c
    sit at most 2f + r (+ c) past p: no position passes twice its token's index, so all are below 2n
    and rope_delta = largest temporal + 1 − n <= n − 1. A decode token's index + rope_delta is then
    at least 1 and below max_len + n − 1 < 2·max_len."""
    return -(max_len // 2), 2 * max_len


def _vision_block(start: int, grid: tuple[int, int, int], scale: float) -> torch.Tensor:
    """Positions [3, T·H'·W'] of one merged grid whose first frame sits at `start`."""
    t, h, w = grid
    ti = (start + torch.arange(t, dtype=torch.float64) * scale).long()[:, None, None].expand(t, h, w)
    hi = ti + (torch.arange(h) - (h - 1) // 2)[None, :, None]
    wi = ti + (torch.arange(w) - (w - 1) // 2)[None, None, :]
    return torch.stack([ti.flatten(), hi.flatten(), wi.flatten()])


def _image_grids(image_grid_thw: Sequence[Grid] | torch.Tensor | None) -> list[tuple[int, ...]]:
    """One (t, h, w) per image, in order."""
    return [tuple(int(v) for v in g) for g in (image_grid_thw if image_grid_thw is not None else [])]


def _frame_grids(video_grid_thw: Sequence[Grid] | torch.Tensor | None) -> list[tuple[int, ...]]:
    """One (1, h, w) per video frame: each `<image>` + `<framePatch>` run takes the next temporal slice."""
    grids = video_grid_thw if video_grid_thw is not None else []
    return [(1, int(h), int(w)) for t, h, w in grids for _ in range(int(t))]


def get_rope_index(
    input_ids: Sequence[int] | torch.Tensor,
    *,
    image_start_token_id: int,
    image_patch_token_id: int,
    video_patch_token_id: int,
    image_grid_thw: Sequence[Grid] | torch.Tensor | None = None,
    video_grid_thw: Sequence[Grid] | torch.Tensor | None = None,
    spatial_merge_size: int = 2,
    scale_factor: float = 2.0,
) -> tuple[torch.Tensor, int]:
    """Positions [3, S] (int64) and rope_delta (= max temporal position + 1 − S) of one prompt.

    Images are `<image>` + `<imagePatch>` runs (one `image_grid_thw` row each, in order); video
    frames are `<image>` + `<framePatch>` runs, each taking the next temporal slice (1, h, w) of
    `video_grid_thw`. Patch counts must match the grids; audio and every other token count as text.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    grids = {
        image_patch_token_id: _image_grids(image_grid_thw),
        video_patch_token_id: _frame_grids(video_grid_thw),
    }
    used = {image_patch_token_id: 0, video_patch_token_id: 0}
    parts: list[torch.Tensor] = []
    text_start, next_pos, i, n = 0, 0, 0, len(ids)
    while i < n:
        if not (ids[i] == image_start_token_id and i + 1 < n and ids[i + 1] in grids):
            i += 1
            continue
        patch = ids[i + 1]
        text_len = i + 1 - text_start  # `<image>` itself is text
        parts.append(torch.arange(next_pos, next_pos + text_len).expand(3, -1))
        next_pos += text_len
        if used[patch] >= len(grids[patch]):
            raise ValueError(f"vision block at token {i + 1} has no grid left (token id {patch})")
        t, h, w = grids[patch][used[patch]]
        used[patch] += 1
        merged = (t, h // spatial_merge_size, w // spatial_merge_size)
        count = merged[0] * merged[1] * merged[2]
        if ids[i + 1 : i + 1 + count] != [patch] * count:
            raise ValueError(
                f"vision block at token {i + 1}: expected {count} patch tokens for grid {(t, h, w)}"
            )
        block = _vision_block(next_pos, merged, scale_factor)
        parts.append(block)
        next_pos = int(block[0].max()) + 1
        i = text_start = i + 1 + count
    parts.append(torch.arange(next_pos, next_pos + n - text_start).expand(3, -1))
    for patch, grid_list in grids.items():
        if used[patch] != len(grid_list):
            raise ValueError(
                f"{len(grid_list) - used[patch]} grid(s) for token id {patch} have no patch tokens"
            )
    positions = torch.cat(parts, dim=1).to(torch.long)
    delta = int(positions[0].max()) + 1 - n if n else 0
    _check_span(positions, delta, n)
    return positions, delta


def _check_span(positions: torch.Tensor, delta: int, n: int) -> None:
    """The prompt's positions within `position_span(n)` and rope_delta <= n − 1 (its decode tokens'
    below 2·max_len): what the rope's table holds. Never refused by the argument there; a guard
    against a change of the layout above that would break it."""
    lo, hi = position_span(n)
    if n and (int(positions.min()) < lo or int(positions.max()) >= hi or delta > n - 1):
        raise ValueError(
            f"positions {int(positions.min())}..{int(positions.max())} (rope_delta {delta}) of a "
            f"{n}-token prompt leave the rope's span [{lo}, {hi})"
        )
