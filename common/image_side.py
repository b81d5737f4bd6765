"""The rule for a requested image side, in one place: a multiple of the latent patch in pixels (the
VAE's 8x times the DiT's 2x2 patch, `IMAGE_SIZE_MULTIPLE`) inside the image stage's
[min_side_px, max_side_px].

The gateway checks it against the limits the image stage reported, before the thinker runs for the
request; the image stage checks it again against its own deploy keys (a client may call it directly).
"""

from __future__ import annotations

from omnistage.common.runtime.errors import InvalidRequest


def check_image_side(field: str, value: int, multiple: int, min_px: int, max_px: int, whose: str) -> int:
    """`value`, or INVALID_ARGUMENT naming `field` and, when out of range, `whose` limits they are."""
    if value % multiple:
        raise InvalidRequest(f"{field}: {value} is not a multiple of {multiple}")
    if not min_px <= value <= max_px:
        raise InvalidRequest(f"{field}: {value} is outside [{min_px}, {max_px}] ({whose})")
    return value
