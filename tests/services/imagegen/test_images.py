"""Resolution buckets (the reference's `process_ratio` tables), the reference image, the PNG."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from omnistage.services.imagegen import images
from PIL import Image


@pytest.mark.parametrize(
    ("hw", "highres", "bucket"),
    [
        ((1024, 1024), 1024, (1024, 1024)),
        ((512, 512), 1024, (1024, 1024)),  # the bucket depends on the aspect only
        ((720, 1280), 1024, (768, 1344)),  # 0.5625 → the 0.57 entry
        ((1280, 720), 1024, (1344, 768)),  # 1.78 → 1.75
        ((256, 1024), 512, (256, 1024)),
        ((512, 512), 512, (512, 512)),
        ((600, 600), 700, (672, 672)),  # the table nearest highres: 672
    ],
)
def test_bucket_for(hw, highres, bucket):
    assert images.bucket_for(*hw, highres) == bucket


def test_tables_match_the_reference():
    assert len(images.ASPECT_RATIO_512) == len(images.ASPECT_RATIO_1024) == 40
    assert images.ASPECT_RATIO_1024["0.25"] == (512, 2048) and images.ASPECT_RATIO_1024["1.13"] == (1088, 960)
    for table in images.TABLES.values():
        assert all(h % 32 == 0 and w % 32 == 0 for h, w in table.values())
    h, w = images.largest_bucket(1024)  # what the stress runs: the most pixels (1024² for this table)
    assert h * w == max(a * b for a, b in images.ASPECT_RATIO_1024.values()) == 1024 * 1024


def _encoded(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "P"])
def test_reference_image_is_rgb_at_the_bucket(mode):
    img = Image.new(mode, (300, 200), 120)
    rgb = images.decode_reference(_encoded(img, "PNG"), (128, 192), max_pixels=1 << 20)
    assert rgb.shape == (128, 192, 3) and rgb.dtype == np.uint8
    want = np.asarray(img.convert("RGB").resize((192, 128), Image.BILINEAR))
    assert np.array_equal(rgb, want)
    x = images.reference_tensor(rgb)
    assert x.shape == (1, 3, 128, 192) and x.min() >= -1 and x.max() <= 1


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (b"not an image at all", "not a supported image"),
        (_encoded(Image.new("RGB", (64, 64)), "PNG")[:60], "cannot be decoded"),
        (
            _encoded(Image.new("RGB", (2000, 1000)), "PNG"),
            "2000x1000 has 2000000 pixels, more than the limit",
        ),
    ],
)
def test_bad_reference_images_are_refused(data, needle):
    with pytest.raises(images.ImageError, match=needle):
        images.decode_reference(data, (64, 64), max_pixels=1 << 20)


def test_png_is_resized_to_the_requested_size():
    rgb = torch.randint(0, 256, (128, 192, 3), dtype=torch.uint8)
    same = Image.open(io.BytesIO(images.png_bytes(rgb, 192, 128)))
    assert same.size == (192, 128) and np.array_equal(np.asarray(same), rgb.numpy())  # lossless, no resize
    small = Image.open(io.BytesIO(images.png_bytes(rgb, 96, 64)))
    assert small.size == (96, 64) and small.format == "PNG"


def test_to_uint8_rounds_as_diffusers():
    x = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0, 2.0]).view(1, 1, 1, 6).expand(1, 3, 1, 6)
    assert images.to_uint8(x)[0, :, 0].tolist() == [0, 64, 128, 191, 255, 255]
