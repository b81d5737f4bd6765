"""Image output (MODALITY_IMAGE): the thinker's hidden states at the image query slots → ImageGen."""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import re
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from omnistage.common.config import IMAGE_SIZE_MULTIPLE, ImageGenConfig
from omnistage.common.image_side import check_image_side
from omnistage.common.runtime.errors import InvalidRequest, StageUnavailable
from omnistage.common.transport import TransportContext
from omnistage.common.transport.release import release_quietly
from omnistage.services.gateway.admission import GateConfig
from omnistage.services.gateway.replicas import Replicas, in_flight_share
from omnistage.services.gateway.stages import ImageGenClient, StageError, broken_stream
from omnistage.services.gateway.validation import MediaPart, PlannedRequest
from omnistage.v1 import common_pb2, control_pb2, imagegen_pb2, omni_pb2, tensor_pb2, thinker_pb2

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


def _image_size(data: bytes, where: str) -> tuple[int, int]:
    """(width, height) from the image header (Pillow reads no pixels for this)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.size
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidRequest(f"{where}: the image to edit cannot be read: {exc}") from None


def _public_details(details: str, image: ImagePlan) -> str:
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


_image_load = in_flight_share(lambda c: c.max_running)


class ImageStage:
    """The gateway's side of the image stage: options, the ImageGen call, lease releases (admission:
    the pipeline's `imagegen` gate, sized by `ImageLimits.gate` summed over the replicas that are up).
    Each request denoises on the least loaded replica that is up (replicas.py) unless pinned to one."""

    def __init__(
        self,
        client: ImageGenClient | Sequence[ImageGenClient],
        transport: TransportContext,
        limits: ImageLimits,
        *,
        allow_cuda_ipc: bool = False,
        service: str | None = None,
    ) -> None:
        self.replicas = Replicas(STAGE, [client] if isinstance(client, ImageGenClient) else client, service)
        self.client = self.replicas.first
        self._pinned: dict[str, ImageGenClient] = {}  # request id → the replica it must use (warm-ups)
        self.transport = transport  # releases only: the gateway maps no bytes of the thinker's refs
        self.limits = limits
        # ImageGen runs on a GPU: hidden states made on the thinker's GPU may stay there (CUDA IPC).
        self.allow_cuda_ipc = allow_cuda_ipc

    def plan(self, request: omni_pb2.GenerateRequest, plan: PlannedRequest) -> ImagePlan:
        return plan_image(request, plan, self.limits)

    def hidden_states_request(self) -> thinker_pb2.HiddenStatesRequest:
        return thinker_pb2.HiddenStatesRequest(allow_cuda_ipc=self.allow_cuda_ipc)

    async def reference_bytes(self, image: ImagePlan, paths: dict[str, Path]) -> bytes:
        """The edited part's bytes (read from `gateway.media_dir` for a path); b"" without an edit."""
        part = image.reference
        if part is None:
            return b""
        if part.media.WhichOneof("source") == "data":
            return part.media.data
        where = f"{part.where}.path"
        limit = self.client.max_message_bytes - MESSAGE_OVERHEAD
        size = paths[where].stat().st_size
        if size > limit:
            raise InvalidRequest(
                f"{where}: the image to edit has {size} bytes, more than the {limit} "
                "one image-stage request takes"
            )
        return await asyncio.to_thread(paths[where].read_bytes)

    async def events(
        self,
        request_id: str,
        image: ImagePlan,
        thinker_events: AsyncIterator[thinker_pb2.ThinkerEvent],
        reference: bytes,
        usage: common_pb2.Usage,
        time_remaining: Callable[[], float | None],
    ) -> AsyncIterator[omni_pb2.GenerateEvent]:
        """Read the thinker's hidden-state stream to its finish (its usage is added to `usage`), then
        stream ImageGen with the client's remaining deadline: a progress event per denoising step,
        then the image."""
        condition: tensor_pb2.TensorRef | None = None
        forwarded = False  # ImageGen answered: it has read (and released) the condition
        try:
            reason = "no finish"
            async for ev in thinker_events:
                kind = ev.WhichOneof("event")
                if kind == "hidden_states":
                    condition = ev.hidden_states.tensor
                elif kind == "finish":
                    usage.prompt_tokens += ev.finish.usage.prompt_tokens
                    usage.cached_prompt_tokens += ev.finish.usage.cached_prompt_tokens
                    reason = common_pb2.FinishReason.Name(ev.finish.reason)
            if condition is None:
                raise StageUnavailable(
                    f"thinker: the hidden-state request ended ({reason}) without hidden states"
                )
            size = (image.width, image.height)
            if image.reference is not None and 0 in size:
                default = edit_size(*_image_size(reference, image.reference.where), self.limits)
                size = (size[0] or default[0], size[1] or default[1])
            request = image.request(request_id, condition, reference, image.prompt_text, size)
            for _ in range(len(self.replicas)):  # another replica when one is found unreachable first
                client = self.replica_for(request_id)
                try:
                    # Closed here (after the image, or when the client leaves): the call's end is taken
                    # or it is cancelled now, not when asyncio's finalizer gets to the generator.
                    async with contextlib.aclosing(client.generate(request, time_remaining())) as events:
                        async for ev in events:
                            forwarded = True
                            if ev.WhichOneof("event") == "progress":
                                p = ev.progress
                                yield omni_pb2.GenerateEvent(
                                    request_id=request_id,
                                    progress=omni_pb2.Progress(stage=STAGE, done=p.step, total=p.total_steps),
                                )
                            else:
                                im = ev.image
                                yield omni_pb2.GenerateEvent(
                                    request_id=request_id,
                                    image=omni_pb2.ImageResult(png=im.png, width=im.width, height=im.height),
                                )
                                return
                except grpc.aio.AioRpcError as exc:
                    if not client.up:  # went down under the call (its StageWatch)
                        raise client.unavailable() from exc
                    if exc.code() == grpc.StatusCode.UNAVAILABLE or broken_stream(exc):
                        client.unreachable(exc.details() or "")  # its watch takes it out now
                        if not forwarded and not client.up and self.replicas.up():
                            continue  # it never began this request: the next replica takes it
                    name = STAGE if len(self.replicas) == 1 else client.name  # a replica is named
                    raise StageError(name, exc, _public_details(exc.details() or "", image)) from exc
                break
            else:
                raise self.replicas.unavailable()
            raise RuntimeError(f"{STAGE}: the stream ended without an image")
        finally:
            if condition is not None and not forwarded:
                self.release([condition])

    def release(self, refs: Sequence[tensor_pb2.TensorRef]) -> None:
        """End the leases of hidden-state refs that will not reach ImageGen (a second release is a no-op)."""
        for ref in refs:
            release_quietly(self.transport, ref, "hidden-state lease")  # the thinker may be gone

    def replica_for(self, request_id: str) -> ImageGenClient:
        """The replica this request denoises on: its pinned one, else the least loaded one that is up
        (UNAVAILABLE naming every replica when none is)."""
        client = self._pinned.get(request_id) or self.replicas.pick(_image_load)
        if client is None:
            raise self.replicas.unavailable()
        return client

    @contextlib.contextmanager
    def pinned(self, request_id: str, client: ImageGenClient) -> Iterator[None]:
        """Within the block, request `request_id` denoises on `client` (a replica's own warm-up)."""
        self._pinned[request_id] = client
        try:
            yield
        finally:
            self._pinned.pop(request_id, None)

    def capacity(self) -> tuple[int, int]:
        """(running, waiting) the replicas that are up take at once: the `imagegen` gate's size. A replica
        whose limits are not read yet counts for what the first one read; none up: the first one's."""
        known = next((c for c in self.replicas.clients if c.max_running), None)
        if known is None:
            gate = self.limits.gate()
            return gate.max_running, gate.max_waiting
        up = self.replicas.up() or [known]
        return (
            sum(c.max_running or known.max_running for c in up),
            sum(c.max_waiting or known.max_waiting for c in up),
        )

    async def close(self) -> None:
        for client in self.replicas.clients:
            await client.close()
        self.transport.close()
