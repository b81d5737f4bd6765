"""Preprocessing contracts (ming.md §3.4, §3.5, §4.2-4.3): sizes, patch order, token counts, timestamps."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnistage.services.encoder import preprocess
from omnistage.services.encoder.models.audio import audio_token_count
from omnistage.services.encoder.models.config import VisionConfig
from omnistage.services.encoder.preprocess import MediaError, smart_resize

MIN_PX, MAX_PX = 4 * 32 * 32, 16384 * 32 * 32
REAL = VisionConfig(
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    out_hidden_size=4096,
    projector_size=4096,
)


@pytest.mark.parametrize(
    ("h", "w", "expected"),
    [
        (448, 448, (448, 448)),  # multiples of 32 stay
        (480, 640, (480, 640)),
        (500, 700, (512, 704)),  # round to the nearest multiple of 32
        (16, 16, (64, 64)),  # below min_pixels: scale up, ceil to 32
        (10, 2000, (32, 1984)),  # a side rounds to 0: at least one factor
        (8000, 6000, (4704, 3520)),  # above max_pixels: scale down, floor to 32
        (1080, 1920, (1088, 1920)),
    ],
)
def test_smart_resize_numbers(h, w, expected):
    out = smart_resize(h, w, 32, MIN_PX, MAX_PX)
    assert out == expected
    assert out[0] % 32 == 0 and out[1] % 32 == 0 and MIN_PX <= out[0] * out[1] <= MAX_PX


def test_smart_resize_refuses_aspect_over_200_and_zero_size():
    assert smart_resize(32, 6400, 32, MIN_PX, MAX_PX) == (32, 6400)  # exactly 200 is allowed
    with pytest.raises(MediaError, match="aspect ratio 201.0"):
        smart_resize(32, 6432, 32, MIN_PX, MAX_PX)
    with pytest.raises(MediaError, match="zero-size"):
        smart_resize(0, 64, 32, MIN_PX, MAX_PX)


def test_patch_order_is_t_blockrow_blockcol_inrow_incol_and_each_patch_is_c_t_y_x():
    """Pixel values encode (frame, channel, y, x); every flattened patch must read back in that order."""
    T, C, H, W = 2, 3, 64, 96
    f, c, y, x = torch.meshgrid(
        torch.arange(T), torch.arange(C), torch.arange(H), torch.arange(W), indexing="ij"
    )
    pixels = (f * 1_000_000 + c * 100_000 + y * 1000 + x).double()
    patches, grid = preprocess.patchify(pixels, REAL)
    assert grid == (1, 4, 6) and patches.shape == (24, 1536)
    p, m = 16, 2
    for n in range(24):
        block, inner = divmod(n, m * m)
        block_row, block_col = divmod(block, 6 // m)
        in_row, in_col = divmod(inner, m)
        row, col = block_row * m + in_row, block_col * m + in_col
        expected = (
            pixels[:, :, row * p : (row + 1) * p, col * p : (col + 1) * p].permute(1, 0, 2, 3).reshape(-1)
        )
        assert torch.equal(patches[n], expected), n


def test_image_is_resized_normalised_and_duplicated_into_two_frames():
    from PIL import Image

    img = Image.fromarray(np.full((40, 70, 3), 128, np.uint8))
    size = smart_resize(40, 70, 32, MIN_PX, MAX_PX)
    patches, grid = preprocess.pixel_patches(preprocess.image_frames(img, size), REAL)
    assert size == (64, 96) and grid == (1, 4, 6)  # 40x70 → 32x64 < min_pixels → scaled up, ceil
    x = patches.view(-1, 3, 2, 16, 16)
    assert torch.equal(x[:, :, 0], x[:, :, 1])  # the two temporal frames are the same image
    expected = (128 / 255 - torch.tensor(preprocess.CLIP_MEAN)) / torch.tensor(preprocess.CLIP_STD)
    assert torch.allclose(x[0, :, 0, 0, 0], expected, atol=1e-6)


@pytest.mark.parametrize(("size", "tokens"), [((448, 448), 196), ((1024, 1024), 1024), ((480, 640), 300)])
def test_image_token_count_is_hw_over_1024(size, tokens):
    from PIL import Image

    img = Image.new("RGB", (size[1], size[0]))
    patches, (t, h, w) = preprocess.pixel_patches(preprocess.image_frames(img, size), REAL)
    assert t * h * w // 4 == tokens == size[0] * size[1] // 1024


@pytest.mark.parametrize(
    ("frames", "tokens"), [(100, 25), (101, 26), (3000, 750), (1, 1), (2, 1), (3, 1), (5, 2)]
)
def test_audio_token_count(frames, tokens):
    assert audio_token_count(frames) == tokens


def test_log_mel_frame_count_is_samples_over_160_without_padding():
    for n in (16000, 16159, 48000 + 77):
        assert preprocess.log_mel(torch.zeros(n) + 0.01, 128).shape == (128, n // 160)
    with pytest.raises(MediaError, match="too short"):
        preprocess.log_mel(torch.zeros(200), 128)


@pytest.mark.parametrize(
    ("total", "fps", "max_frames", "count"),
    [
        (300, 30.0, 256, 20),  # 10 s at 30 fps → 2 fps → 20 frames
        (25, 10.0, 256, 4),  # 2.5 s → 5 → at least 4, even
        (3, 30.0, 256, 2),  # fewer frames than the minimum: all of them, even
        (36000, 30.0, 256, 256),  # 20 min: capped at 256
        (1000, 25.0, 64, 64),
    ],
)
def test_video_frame_count(total, fps, max_frames, count):
    assert preprocess.video_frame_count(total, fps, max_frames) == count


def test_a_one_frame_video_is_refused():
    with pytest.raises(MediaError, match="at least 2"):
        preprocess.video_frame_count(1, 30.0, 256)


def test_video_indices_timestamps_and_pixel_budget():
    idx = preprocess.video_frame_indices(300, 20)
    assert idx[0] == 0 and idx[-1] == 299 and len(idx) == 20 and idx == sorted(idx)
    times = [i / 30.0 for i in idx]
    stamps = preprocess.temporal_patch_times(times)
    assert len(stamps) == 10
    assert stamps[0] == pytest.approx((times[0] + times[1]) / 2) and stamps[-1] == pytest.approx(
        (times[-2] + times[-1]) / 2
    )
    lo, hi = preprocess.video_pixel_range(20, 131072, 12582912)
    assert (lo, hi) == (131072, 12582912 // 10)
    assert preprocess.video_pixel_range(256, 131072, 12582912)[1] == int(131072 * 1.05)  # the floor wins


def test_video_token_count_per_temporal_patch():
    frames = [np.zeros((64, 96, 3), np.uint8)] * 6
    patches, grid = preprocess.pixel_patches(preprocess.stack_frames(frames), REAL)
    assert grid == (3, 4, 6) and patches.shape[0] == 72  # 3 temporal patches x 6 tokens each x 4
