"""3D position ids on the worked examples of ming.md §2.3."""

from __future__ import annotations

import random

import pytest
from omnistage.services.thinker.models.rope_index import get_rope_index, position_span

X, IMG, PATCH, IMG_END, FRAME = 1, 10, 11, 12, 13
IDS = {"image_start_token_id": IMG, "image_patch_token_id": PATCH, "video_patch_token_id": FRAME}


def test_worked_example():
    ids = [X, X, X, IMG] + [PATCH] * 6 + [IMG_END, X, X]
    pos, delta = get_rope_index(ids, image_grid_thw=[(1, 4, 6)], **IDS)
    assert pos.tolist() == [
        [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 5, 6, 7],
        [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 5, 6, 7],
        [0, 1, 2, 3, 3, 4, 5, 3, 4, 5, 5, 6, 7],
    ]
    assert delta == -5


def test_image_gen_query_block():
    prompt = [X] * 9
    ids = prompt + [IMG] + [PATCH] * 256 + [IMG_END]
    pos, delta = get_rope_index(ids, image_grid_thw=[(1, 2, 512)], **IDS)
    p = len(prompt) + 1
    block = pos[:, p : p + 256]
    assert block[0].tolist() == [p] * 256 and block[1].tolist() == [p] * 256
    assert block[2].tolist() == list(range(p - 127, p + 129))
    assert pos[:, -1].tolist() == [p + 1] * 3
    assert delta == p + 2 - len(ids)


def test_video_frames_take_grid_slices_and_text_only():
    # Two frame groups from one video grid (t=2, h=4, w=4 → each slice 2x2 merged), timestamps as text.
    ids = [X, 20, IMG] + [FRAME] * 4 + [IMG_END, 21, IMG] + [FRAME] * 4 + [IMG_END]
    pos, delta = get_rope_index(ids, video_grid_thw=[(2, 4, 4)], **IDS)
    assert pos[0].tolist() == [0, 1, 2, 3, 3, 3, 3, 4, 5, 6, 7, 7, 7, 7, 8]
    assert pos[1, 3:7].tolist() == [3, 3, 4, 4] and pos[2, 3:7].tolist() == [3, 4, 3, 4]
    assert delta == 9 - len(ids)
    text, d = get_rope_index([X] * 5, **IDS)
    assert text.tolist() == [list(range(5))] * 3 and d == 0


def test_multi_frame_image_grid_scales_time():
    ids = [IMG] + [PATCH] * 8 + [X]
    pos, _ = get_rope_index(ids, image_grid_thw=[(2, 4, 4)], **IDS)
    assert pos[0].tolist() == [0] + [1] * 4 + [3] * 4 + [4]


def test_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="patch tokens"):
        get_rope_index([IMG] + [PATCH] * 5 + [X], image_grid_thw=[(1, 4, 6)], **IDS)
    with pytest.raises(ValueError, match="grid"):
        get_rope_index([X, X], image_grid_thw=[(1, 4, 6)], **IDS)


def _random_prompt(rng: random.Random) -> tuple[list[int], list[tuple[int, int, int]]]:
    """Text and images at random: grids from one patch (a 1 x 1 frame stack, the fastest temporal
    climb) to a wide row (the deepest centring), an image first or after text."""
    ids, grids = [], []
    for _ in range(rng.randrange(1, 5)):
        ids += [X] * rng.choice([0, 0, 1, rng.randrange(2, 30)])
        t, h, w = rng.choice(
            [(rng.randrange(1, 6), 1, 1), (1, 1, rng.randrange(2, 300)), (2, 3, 5), (1, 7, 2)]
        )
        ids += [IMG] + [PATCH] * (t * h * w)
        grids.append((t, h, w))
    return ids + [X] * rng.randrange(0, 3), grids


def test_every_position_and_the_decodes_lie_in_the_span():
    """A prompt's positions lie in position_span(n), and its decode tokens' (index + rope_delta,
    index up to any max_len >= n) in position_span(max_len): what the rope's table holds."""
    rng = random.Random(0)
    for _ in range(300):
        ids, grids = _random_prompt(rng)
        n = len(ids)
        pos, delta = get_rope_index(ids, image_grid_thw=grids, spatial_merge_size=1, **IDS)
        lo, hi = position_span(n)
        assert lo <= int(pos.min()) and int(pos.max()) < hi, (ids, grids)
        for max_len in (n, 2 * n + 7):
            lo, hi = position_span(max_len)
            assert lo <= n + delta and max_len - 1 + delta < hi


def test_a_layout_that_would_leave_the_span_is_refused():
    ids = [IMG] + [PATCH] * 4  # four 1 x 1 frames eight apart: 1, 9, 17, 25 from five tokens
    with pytest.raises(ValueError, match="leave the rope's span"):
        get_rope_index(ids, image_grid_thw=[(4, 1, 1)], spatial_merge_size=1, scale_factor=8.0, **IDS)
    pos, _ = get_rope_index(ids, image_grid_thw=[(4, 1, 1)], spatial_merge_size=1, **IDS)
    assert pos[0].tolist() == [0, 1, 3, 5, 7]
