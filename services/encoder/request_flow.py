"""EncoderEngine: the encoder's request flow — items in, embeddings out as TensorRefs: validate,
preprocess, a batch slot per item (its units of its modality's budget: a clip's mel frames), the
runner's forward, hand over."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from omnistage.common import metrics
from omnistage.common.config import EncoderConfig
from omnistage.common.log import get_logger
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop
from omnistage.common.runtime.errors import InvalidRequest, Overloaded
from omnistage.common.transport import TransportContext, encode
from omnistage.services.encoder.items import AudioInput, Grid, ItemLimits, MediaItem, ModelInput, prepare_item
from omnistage.services.encoder.models.loader import EncoderModels
from omnistage.services.encoder.preprocess import MediaError
from omnistage.services.encoder.runner import EncoderRunner, Entry, queue_time_histogram
from omnistage.v1 import tensor_pb2

log = get_logger(__name__)
MODALITY = {"image": "vision", "video": "vision", "audio": "audio"}


def items_counter():
    return metrics.counter("encoder_items", "Media items encoded, by kind", ("kind",))


def tokens_counter():
    return metrics.counter("encoder_tokens", "Embedding rows (thinker tokens) produced, by kind", ("kind",))


def prepare_time_histogram():
    return metrics.histogram(
        "encoder_prepare_seconds",
        "Time to decode and preprocess one item on the preprocessing pool (its wait for a thread "
        "included), by kind",
        ("kind",),
    )


def batch_budgets(caps: dict[str, int], limits: ItemLimits) -> dict[str, int]:
    """Each modality's budget per forward, in units (items × the largest item's units; `batch_units`):
    vision, the stress's cap of items; audio, the cap × the longest clip's mel frames (what the stress
    ran), lowered by `audio_batch_frames` (a clip longer than that runs alone: `_submit`)."""
    audio = caps["audio"] * limits.max_audio_frames
    if limits.encoder.audio_batch_frames:
        audio = min(audio, limits.encoder.audio_batch_frames)
    return {"vision": caps["vision"], "audio": audio}


@dataclass(frozen=True)
class EncodedOutput:
    """One item's result; `ref` is leased to the consumer."""

    kind: str
    ref: tensor_pb2.TensorRef
    num_tokens: int
    placeholder_token_id: int
    merged_grids: tuple[Grid, ...] = ()
    timestamps_s: tuple[float, ...] = ()
    duration_s: float = 0.0
    resized: tuple[int, int] = (0, 0)


class EncoderEngine:
    """The encoder's only API for the servicer: `await encode(items, ...)`."""

    def __init__(
        self,
        models: EncoderModels,
        cfg: EncoderConfig,
        transport: TransportContext,
        caps: dict[str, int],
        *,
        service: str = "encoder",
        on_failure: Callable[[DeviceFailed], None] | None = None,
    ) -> None:
        self.models = models
        self.cfg = cfg
        self.service = service
        self.transport = transport
        self.limits = ItemLimits.of(cfg, models.config)
        self.placeholders = {
            "image": models.config.placeholders.image_patch,
            "video": models.config.placeholders.video_patch,
            "audio": models.config.placeholders.audio_patch,
        }
        self._pool = ThreadPoolExecutor(cfg.preprocess_workers, thread_name_prefix=f"{service}-prep")
        self._handover_stream: torch.cuda.Stream | None = None  # made at start() on a GPU
        budgets = batch_budgets(caps, self.limits)
        self.runner = EncoderRunner(service, models, budgets)
        self.limiters = {
            m: ConcurrencyLimiter(f"{service} {m}", budgets[m], unit="mel frames" if m == "audio" else "")
            for m in self.runner.forwards
        }
        self.loop = DeviceLoop(service, self.runner)
        if on_failure is not None:
            self.loop.on_failure.append(on_failure)

    # -- life cycle --------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the device thread (`loop` is not needed any more: outputs go to each item's own loop)."""
        device = self.models.audio.linear_proj_audio[0].weight.device
        if device.type == "cuda":
            self._handover_stream = torch.cuda.Stream(device)
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop(10.0)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def leases(self) -> tuple[int, int]:
        """(active leases, leased bytes) of this process's shm pool, released slices reclaimed first."""
        pool = self.transport.shm_pool()
        if pool is None:
            return 0, 0
        pool.arena.reclaim()
        return pool.arena.active_leases, pool.arena.used_bytes

    def export_lease_gauges(self) -> None:
        """/metrics: embeddings handed out and not yet released (a leak shows as a gauge that never falls)."""
        active = metrics.gauge(
            "encoder_leases_active", "Embedding slices leased to consumers, not yet released"
        )
        used = metrics.gauge("encoder_leased_bytes", "Bytes of the shm pool leased to consumers")
        active.labels(self.service).set_function(lambda: self.leases()[0])
        used.labels(self.service).set_function(lambda: self.leases()[1])

    def export_queue_time(self) -> None:
        """/metrics: each item's wait before its forward, from now on (after the warm-up: clients' items only)."""
        self.runner.on_queued = queue_time_histogram().labels(self.service).observe

    # -- requests ----------------------------------------------------------------------------

    async def encode(
        self,
        items: Sequence[MediaItem],
        *,
        timeout_s: float | None = None,
        consumer_host_id: str = "",
        allow_cuda_ipc: bool = False,
    ) -> list[EncodedOutput]:
        """Encode every item or none: INVALID_ARGUMENT names the first bad item.

        `timeout_s` is the request's remaining deadline (None: none). An item waits for a batch slot at
        most `queue_timeout_s` (then RESOURCE_EXHAUSTED with pushback) or until the deadline
        (DEADLINE_EXCEEDED), whichever comes first.
        """
        if not items:
            raise InvalidRequest("items: at least one item is required")
        if len(items) > self.cfg.max_items_per_request:
            raise InvalidRequest(
                f"items: {len(items)} items exceed the limit of {self.cfg.max_items_per_request} "
                "(encoder.max_items_per_request)"
            )
        deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        inputs = await self._prepare_all(items)
        tensors = await asyncio.gather(*(self._forward(x, deadline) for x in inputs))
        handover = asyncio.get_running_loop().run_in_executor(
            self._pool, self._to_refs, tensors, consumer_host_id, allow_cuda_ipc
        )
        try:
            refs = await asyncio.shield(handover)
        except asyncio.CancelledError:  # the caller left: its refs will never be sent
            handover.add_done_callback(self._revoke_when_done)
            raise
        for x in inputs:
            items_counter().labels(self.service, x.kind).inc()
            tokens_counter().labels(self.service, x.kind).inc(x.num_tokens)
        return [self._output(x, ref) for x, ref in zip(inputs, refs, strict=True)]

    async def _prepare_all(self, items: Sequence[MediaItem]) -> list[ModelInput]:
        loop = asyncio.get_running_loop()
        results = await asyncio.gather(
            *(loop.run_in_executor(self._pool, self._prepare, item, time.monotonic()) for item in items),
            return_exceptions=True,
        )
        for i, r in enumerate(results):
            if isinstance(r, MediaError):
                raise InvalidRequest(f"items[{i}] ({items[i].kind}): {r}")
            if isinstance(r, BaseException):  # a defect, not the client's fault: INTERNAL, naming the item
                raise RuntimeError(f"items[{i}] ({items[i].kind}): {type(r).__name__}: {r}") from r
        return list(results)  # type: ignore[arg-type]

    def _prepare(self, item: MediaItem, asked: float) -> ModelInput:
        x = prepare_item(item, self.limits)
        prepare_time_histogram().labels(self.service, item.kind).observe(time.monotonic() - asked)
        return x

    async def _forward(self, x: ModelInput, deadline: float) -> torch.Tensor:
        modality = MODALITY[x.kind]
        try:
            out = await self._submit(modality, x, deadline)
        except (
            torch.OutOfMemoryError
        ) as exc:  # the stress cap should prevent this; tell the client to back off
            raise Overloaded(
                f"{self.service}: {modality} forward ran out of device memory", retry_after_ms=1000
            ) from exc
        if out.shape[0] != x.num_tokens:
            raise RuntimeError(f"{x.kind} produced {out.shape[0]} rows, expected {x.num_tokens}")
        return out

    async def _submit(self, modality: str, item: ModelInput, deadline: float) -> Any:
        """Queue `item` once its units of its modality's budget are free (the limiter's refusals:
        queue_timeout_s, the deadline) and await its output. The units are held until the item's
        forward has finished, even when the caller gives up, so a cancelled request never lets more
        than the tested batch onto the device."""
        arrived = time.monotonic()
        limiter = self.limiters[modality]
        units = min(item.batch_units, limiter.limit)  # a clip past the budget: all of it, and alone
        async with limiter.admit(
            deadline, self.cfg.queue_timeout_s, what=f"a {modality} batch slot", units=units
        ):
            entry = Entry(item, asyncio.get_running_loop().create_future(), arrived, units)
            self.loop.admit(lambda: self.runner.put(modality, entry))
            try:
                return await asyncio.shield(entry.future)
            except asyncio.CancelledError:
                entry.cancelled = True  # skipped if its forward has not started
                with contextlib.suppress(BaseException):
                    await entry.future  # keep the slot until the device is done with the item
                raise

    def _to_refs(self, tensors: Sequence[torch.Tensor], consumer_host_id: str, allow_cuda_ipc: bool) -> list:
        """TensorRefs of all outputs, or none: on any failure the slices already leased are revoked. On a
        GPU the copies run on the hand-over's own stream: on the device thread's, behind the next forward
        it launched meanwhile, a request's answer waited for that forward too (the outputs are complete:
        the runner waits for each forward's device work before handing its outputs over)."""
        refs: list[tensor_pb2.TensorRef] = []
        stream = self._handover_stream
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for t in tensors:
                    refs.append(self._ref(t, consumer_host_id, allow_cuda_ipc))
        except BaseException:
            for ref in refs:
                self.transport.revoke(ref)
            raise
        return refs

    def _revoke_when_done(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is None:
            for ref in fut.result():
                self.transport.revoke(ref)

    def _ref(self, t: torch.Tensor, consumer_host_id: str, allow_cuda_ipc: bool) -> tensor_pb2.TensorRef:
        remote = bool(consumer_host_id) and consumer_host_id != self.transport.host_id
        if remote:
            return encode(t, transport=self.transport, peer_host_id=consumer_host_id)
        nbytes = t.numel() * t.element_size()
        if t.is_cuda and not allow_cuda_ipc and nbytes >= self.transport.options.shm_threshold_bytes:
            return encode(t, transport=self.transport, force="shm")  # the consumer cannot open CUDA IPC
        return encode(t, transport=self.transport)

    def _output(self, x: ModelInput, ref: tensor_pb2.TensorRef) -> EncodedOutput:
        common = dict(
            kind=x.kind, ref=ref, num_tokens=x.num_tokens, placeholder_token_id=self.placeholders[x.kind]
        )
        if isinstance(x, AudioInput):
            return EncodedOutput(**common, duration_s=x.duration_s)
        return EncodedOutput(
            **common,
            merged_grids=tuple(x.merged_grids),
            timestamps_s=x.timestamps_s,
            duration_s=x.duration_s,
            resized=x.resized,
        )

    def revoke(self, outputs: Sequence[EncodedOutput]) -> None:
        """Take back the leases of outputs that will never be sent (the RPC failed after encoding)."""
        for out in outputs:
            self.transport.revoke(out.ref)
