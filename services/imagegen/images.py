"""Pixels in and out: resolution buckets, the edit's reference image, the PNG (ming.md §6.3)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# height/width ratio → (height, width): the reference's 512 and 672 tables; the 1024 table is the
# 512 one doubled, entry for entry, as in the reference.
ASPECT_RATIO_512: dict[str, tuple[int, int]] = {
    "0.25": (256, 1024),
    "0.26": (256, 992),
    "0.27": (256, 960),
    "0.28": (256, 928),
    "0.32": (288, 896),
    "0.33": (288, 864),
    "0.35": (288, 832),
    "0.4": (320, 800),
    "0.42": (320, 768),
    "0.48": (352, 736),
    "0.5": (352, 704),
    "0.52": (352, 672),
    "0.57": (384, 672),
    "0.6": (384, 640),
    "0.68": (416, 608),
    "0.72": (416, 576),
    "0.78": (448, 576),
    "0.82": (448, 544),
    "0.88": (480, 544),
    "0.94": (480, 512),
    "1.0": (512, 512),
    "1.07": (512, 480),
    "1.13": (544, 480),
    "1.21": (544, 448),
    "1.29": (576, 448),
    "1.38": (576, 416),
    "1.46": (608, 416),
    "1.67": (640, 384),
    "1.75": (672, 384),
    "2.0": (704, 352),
    "2.09": (736, 352),
    "2.4": (768, 320),
    "2.5": (800, 320),
    "2.89": (832, 288),
    "3.0": (864, 288),
    "3.11": (896, 288),
    "3.62": (928, 256),
    "3.75": (960, 256),
    "3.88": (992, 256),
    "4.0": (1024, 256),
}
ASPECT_RATIO_672: dict[str, tuple[int, int]] = {
    "0.28": (352, 1280),
    "0.32": (384, 1184),
    "0.38": (416, 1088),
    "0.44": (448, 1024),
    "0.52": (480, 928),
    "0.57": (512, 896),
    "0.65": (544, 832),
    "0.75": (576, 768),
    "0.83": (608, 736),
    "0.91": (640, 704),
    "1.00": (672, 672),
    "1.10": (704, 640),
    "1.21": (736, 608),
    "1.33": (768, 576),
    "1.39": (800, 576),
    "1.53": (832, 544),
    "1.69": (864, 512),
    "1.75": (896, 512),
    "1.93": (928, 480),
    "2.00": (960, 480),
    "2.21": (992, 448),
    "2.29": (1024, 448),
    "2.54": (1056, 416),
    "2.62": (1088, 416),
    "2.69": (1120, 416),
    "3.00": (1152, 384),
    "3.08": (1184, 384),
    "3.17": (1216, 384),
    "3.55": (1248, 352),
    "3.64": (1280, 352),
}
ASPECT_RATIO_1024 = {k: (2 * h, 2 * w) for k, (h, w) in ASPECT_RATIO_512.items()}
TABLES = {512: ASPECT_RATIO_512, 672: ASPECT_RATIO_672, 1024: ASPECT_RATIO_1024}
MIN_ASPECT, MAX_ASPECT = 0.25, 4.0  # height / width a request may ask for


class ImageError(ValueError):
    """A reference image that cannot be used; the message says why (the caller names the field)."""


def bucket_table(highres: int) -> dict[str, tuple[int, int]]:
    """The table nearest `highres` (512, 672 or 1024), as the reference picks it."""
    return TABLES[min(TABLES, key=lambda r: abs(r - highres))]


def bucket_for(height: int, width: int, highres: int) -> tuple[int, int]:
    """(height, width) the DiT generates at for a requested size: the closest height/width ratio."""
    table = bucket_table(highres)
    ratio = height / width
    return table[min(table, key=lambda k: abs(float(k) - ratio))]


def largest_bucket(highres: int) -> tuple[int, int]:
    """The bucket with the most pixels (the start-up stress runs it)."""
    return max(bucket_table(highres).values(), key=lambda hw: (hw[0] * hw[1], hw[0]))


def decode_reference(data: bytes, bucket: tuple[int, int], max_pixels: int) -> np.ndarray:
    """Encoded image bytes → uint8 RGB [height, width, 3] at the bucket (bilinear). Raises ImageError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
            w, h = img.size
            if w * h > max_pixels:
                raise ImageError(
                    f"{w}x{h} has {w * h} pixels, more than the limit of {max_pixels} "
                    "(imagegen.max_reference_pixels)"
                )
            img.load()
    except ImageError:
        raise
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"not a supported image ({type(exc).__name__})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise ImageError(f"cannot be decoded: {exc}") from None
    if img.width < 1 or img.height < 1:
        raise ImageError("empty image")
    bh, bw = bucket
    return np.array(img.convert("RGB").resize((bw, bh), Image.BILINEAR))


def reference_tensor(rgb: np.ndarray) -> torch.Tensor:
    """uint8 [H, W, 3] → float32 [1, 3, H, W] in [-1, 1] (to_tensor, then (x − 0.5) · 2)."""
    x = torch.tensor(rgb).permute(2, 0, 1).float().div(255.0)
    return ((x - 0.5) * 2.0).unsqueeze(0)


def to_uint8(image: torch.Tensor) -> torch.Tensor:
    """VAE output [1, 3, H, W] in [-1, 1] → uint8 [H, W, 3] on the CPU (diffusers' postprocess rounding)."""
    x = (image[0] * 0.5 + 0.5).clamp(0, 1)  # in the VAE's dtype, as the reference denormalises
    return (x.float().cpu().permute(1, 2, 0) * 255).round().to(torch.uint8)


def png_bytes(rgb: torch.Tensor, width: int, height: int) -> bytes:
    """uint8 [H, W, 3] → PNG bytes at width × height (Lanczos resize when the size differs)."""
    img = Image.fromarray(rgb.numpy())
    if img.size != (width, height):
        img = img.resize((width, height), Image.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
