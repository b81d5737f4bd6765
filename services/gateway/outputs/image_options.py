"""What an image request may ask for (MODALITY_IMAGE): the image stage's limits, the request's checked
options, and the image stage's field names in its refusals as the client's."""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass

from omnistage.common.config import IMAGE_SIZE_MULTIPLE, ImageGenConfig
from omnistage.common.image_side import check_image_side
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.services.gateway.admission import GateConfig
from omnistage.services.gateway.validation import MediaPart, PlannedRequest
from omnistage.v1 import control_pb2, imagegen_pb2, omni_pb2, tensor_pb2

STAGE = "imagegen"
# Room kept in an ImageGen message for everything but the reference image's bytes.
MESSAGE_OVERHEAD = 64 << 10
# ImageGen's field names in its refusals → the client's (`reference_image` → the edited part).
_STAGE_FIELD = re.compile(
    r"^(height / width|width|height|steps|guidance_scale|seed|reference_image)(?=[:. ])"
)


@dataclass(frozen=True)
class ImageLimits:
    """What an image request may ask for: the image stage's Describe limits (its deploy-file section
    where it has no admin port) plus its guidance bound, which Describe does not report."""

    min_side_px: int = 64
    max_side_px: int = 2048
    max_steps: int = 100
    max_guidance_scale: float = 20.0
    max_batch: int = 1  # requests denoising at once (the stage's stress-tested cap)
    max_queued: int = 64  # requests the stage lets wait for a denoising slot

    def gate(self) -> GateConfig:
        """The gateway's admission to the stage: `max_batch` at once, `max_queued` waiting (more would
        only be refused by the stage after the thinker has done their prefill)."""
        return GateConfig(self.max_batch, self.max_queued)

    @classmethod
    def of(cls, cfg: ImageGenConfig, limits: control_pb2.Limits | None) -> ImageLimits:
        if limits is None:
            return cls(
                cfg.min_side_px,
                cfg.max_side_px,
                cfg.max_steps,
                cfg.max_guidance_scale,
                max(cfg.stress_batch_sizes, default=1),
                cfg.max_queued_requests,
            )
        return cls(
            limits.min_image_side_px or cfg.min_side_px,
            limits.max_image_side_px or cfg.max_side_px,
            limits.max_denoising_steps or cfg.max_steps,
            cfg.max_guidance_scale,
            limits.max_image_batch or 1,
            limits.max_queued_requests,
        )


@dataclass(frozen=True)
class ImagePlan:
    """A checked image request: what ImageGen gets (0 / None: the stage's default) and the edited part."""

    width: int
    height: int
    steps: int | None
    guidance_scale: float | None
    seed: int | None
    reference: MediaPart | None  # an edit: the last image part of the last user message
    prompt_text: str = ""  # the last user message's text (ImageGen's glyph path, not used by it yet)

    def request(
        self,
        request_id: str,
        condition: tensor_pb2.TensorRef,
        reference: bytes,
        prompt_text: str,
        size: tuple[int, int],
    ) -> imagegen_pb2.ImageGenRequest:
        """The ImageGen request; `size` is (width, height) with an edit's defaults applied."""
        req = imagegen_pb2.ImageGenRequest(
            request_id=request_id,
            condition=condition,
            width=size[0],
            height=size[1],
            prompt_text=prompt_text,
            reference_image=reference,
        )
        if self.steps is not None:
            req.steps = self.steps
        if self.guidance_scale is not None:
            req.guidance_scale = self.guidance_scale
        if self.seed is not None:
            req.seed = self.seed
        return req


def plan_image(request: omni_pb2.GenerateRequest, plan: PlannedRequest, limits: ImageLimits) -> ImagePlan:
    """Check `request.image` against the stage's limits; INVALID_ARGUMENT names the field."""
    opts = request.image
    for name in ("width", "height"):
        value = getattr(opts, name)
        if value != 0:
            check_image_side(
                f"image.{name}",
                value,
                IMAGE_SIZE_MULTIPLE,
                limits.min_side_px,
                limits.max_side_px,
                "the image stage's limits",
            )
    if opts.steps > limits.max_steps:
        raise InvalidRequest(
            f"image.steps: {opts.steps} exceeds the image stage's limit of {limits.max_steps}"
        )
    g = opts.guidance_scale
    if not math.isfinite(g) or g < 0:
        raise InvalidRequest(f"image.guidance_scale: must be a finite number >= 0, got {g:g}")
    if g > limits.max_guidance_scale:
        raise InvalidRequest(
            f"image.guidance_scale: {g:g} exceeds the image stage's limit of {limits.max_guidance_scale:g}"
        )
    reference = None
    if opts.edit:
        last = f"messages[{len(request.messages) - 1}]."
        images = [m for m in plan.media if m.kind == "image" and m.where.startswith(last)]
        if not images:
            raise InvalidRequest("image.edit: the last user message has no image part to edit")
        reference = images[-1]
    text = " ".join(p for p in plan.turns[-1].parts() if isinstance(p, str))
    return ImagePlan(
        opts.width,
        opts.height,
        opts.steps or None,
        g or None,
        opts.seed if opts.HasField("seed") else None,
        reference,
        text,
    )


def edit_size(width: int, height: int, limits: ImageLimits) -> tuple[int, int]:
    """An edit's default size: the reference's, scaled down to fit the largest side allowed, each
    side then rounded to a multiple of 16 within the limits."""
    scale = min(1.0, limits.max_side_px / max(width, height))

    def side(v: int) -> int:
        rounded = math.floor(v * scale / IMAGE_SIZE_MULTIPLE + 0.5) * IMAGE_SIZE_MULTIPLE  # halves round up
        return min(max(rounded, limits.min_side_px), limits.max_side_px)

    return side(width), side(height)


def image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the image header (Pillow reads no pixels for this)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image to edit cannot be read: {exc}") from None


def public_details(details: str, image: ImagePlan) -> str:
    """ImageGen's field names in a refusal → the request's (`width: …` → `image.width: …`)."""
    match = _STAGE_FIELD.match(details)
    if match is None:
        return details
    field = match[1]
    if field == "reference_image":
        name = image.reference.where if image.reference is not None else "image.edit"
    else:
        name = " / ".join(f"image.{f}" for f in field.split(" / "))
    return name + details[match.end() :]
