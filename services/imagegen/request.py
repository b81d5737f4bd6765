"""ImageGenRequest → GenerationSpec: every field checked, errors naming the field (INVALID_ARGUMENT).

Runs on a worker thread (it copies the conditioning out of shared memory and decodes the
reference image). The conditioning's dtype and shape are checked from the TensorRef before its
bytes are read; its shared-memory lease is released at once, whatever the outcome.
"""

from __future__ import annotations

import contextlib
import math
import secrets
from dataclasses import dataclass

import torch
from omnistage.common.config import ImageGenConfig
from omnistage.common.image_side import check_image_side
from omnistage.common.runtime.errors import InvalidRequest
from omnistage.common.transport import TransportContext, TransportError, decode, from_proto_dtype
from omnistage.services.imagegen import images
from omnistage.services.imagegen.pipeline import GenerationSpec
from omnistage.v1 import imagegen_pb2, tensor_pb2

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask for: the service config plus the model's shapes."""

    cfg: ImageGenConfig
    num_queries: int
    thinker_hidden: int
    size_multiple: int


@dataclass(frozen=True)
class ParsedRequest:
    spec: GenerationSpec
    width: int  # of the returned PNG
    height: int


def parse_request(
    req: imagegen_pb2.ImageGenRequest, limits: RequestLimits, transport: TransportContext
) -> ParsedRequest:
    """Every field checked (the conditioning last); INVALID_ARGUMENT names the first bad one."""
    try:
        width, height, steps, guidance, seed, bucket, reference = _fields(req, limits)
    except BaseException:
        if req.HasField("condition"):
            _release(req.condition, transport)
        raise
    condition = _condition(req, limits, transport)
    spec = GenerationSpec(condition, bucket, steps, float(guidance), seed, reference)
    return ParsedRequest(spec, width, height)


def _fields(req: imagegen_pb2.ImageGenRequest, limits: RequestLimits):
    cfg = limits.cfg
    width = _side("width", req.width or cfg.default_side_px, limits)
    height = _side("height", req.height or cfg.default_side_px, limits)
    aspect = height / width
    if not images.MIN_ASPECT <= aspect <= images.MAX_ASPECT:
        raise InvalidRequest(
            f"height / width: aspect ratio {height}/{width} = {aspect:.3g} is outside "
            f"[{images.MIN_ASPECT}, {images.MAX_ASPECT}]"
        )
    steps = req.steps if req.HasField("steps") else cfg.default_steps
    if steps < 1:
        raise InvalidRequest(
            f"steps: must be at least 1, got {steps} (leave it unset for {cfg.default_steps})"
        )
    if steps > cfg.max_steps:
        raise InvalidRequest(f"steps: {steps} exceeds the limit of {cfg.max_steps} (imagegen.max_steps)")
    guidance = req.guidance_scale if req.HasField("guidance_scale") else cfg.default_guidance_scale
    if not math.isfinite(guidance):
        raise InvalidRequest(f"guidance_scale: must be a finite number, got {guidance}")
    if guidance < 0:
        raise InvalidRequest(f"guidance_scale: must be >= 0, got {guidance:g}")
    if guidance > cfg.max_guidance_scale:
        raise InvalidRequest(
            f"guidance_scale: {guidance:g} exceeds the limit of {cfg.max_guidance_scale:g} "
            "(imagegen.max_guidance_scale)"
        )
    seed = req.seed if req.HasField("seed") else secrets.randbits(63)
    bucket = images.bucket_for(height, width, cfg.highres)
    reference = None
    if req.reference_image:
        if not cfg.allow_edits:
            raise InvalidRequest(
                "reference_image: edits are turned off on this service (imagegen.allow_edits)"
            )
        try:
            reference = images.decode_reference(req.reference_image, bucket, cfg.max_reference_pixels)
        except images.ImageError as exc:
            raise InvalidRequest(f"reference_image: {exc}") from None
    return width, height, steps, guidance, seed, bucket, reference


def _side(name: str, value: int, limits: RequestLimits) -> int:
    cfg = limits.cfg
    return check_image_side(
        name,
        value,
        limits.size_multiple,
        cfg.min_side_px,
        cfg.max_side_px,
        "imagegen.min_side_px / max_side_px",
    )


def _condition(
    req: imagegen_pb2.ImageGenRequest, limits: RequestLimits, transport: TransportContext
) -> torch.Tensor:
    want = [limits.num_queries, limits.thinker_hidden]
    what = (
        f"the thinker's final-norm hidden states at the {limits.num_queries} image query slots, "
        f"{want} bfloat16/float16/float32"
    )
    if not req.HasField("condition"):
        raise InvalidRequest(f"condition: required ({what})")
    ref = req.condition
    try:
        try:
            dtype = from_proto_dtype(ref.dtype)
        except TypeError as exc:
            raise InvalidRequest(f"condition.dtype: {exc} ({what})") from None
        if dtype not in FLOAT_DTYPES:
            raise InvalidRequest(
                f"condition.dtype: expected bfloat16, float16 or float32, got {dtype} ({what})"
            )
        if list(ref.shape) != want:
            raise InvalidRequest(f"condition.shape: expected {want}, got {list(ref.shape)} ({what})")
        try:
            t = decode(ref, transport=transport)  # copies and releases the lease
        except (TransportError, ValueError, OSError) as exc:
            raise InvalidRequest(f"condition: {exc}") from None
    except InvalidRequest:
        _release(ref, transport)
        raise
    if not torch.isfinite(t).all():
        raise InvalidRequest("condition: contains NaN or infinite values")
    return t


def _release(ref: tensor_pb2.TensorRef, transport: TransportContext) -> None:
    """Hand a refused shared-memory slice back to its producer at once (best effort)."""
    if ref.WhichOneof("payload") in ("shm", "cuda"):
        with contextlib.suppress(Exception):
            transport.release(ref)
