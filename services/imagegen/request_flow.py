"""ImageGenEngine: the image stage's request flow, the servicer's only API — parse, admit (a denoising
slot), stream the runner's `Progress`, hand back the PNG (`ImageResult`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from omnistage.common import metrics
from omnistage.common.config import ImageGenConfig
from omnistage.common.runtime.concurrency import ConcurrencyLimiter
from omnistage.common.runtime.device_loop import DeviceFailed, DeviceLoop
from omnistage.common.transport import TransportContext
from omnistage.services.imagegen import images
from omnistage.services.imagegen.pipeline import ImagePipeline
from omnistage.services.imagegen.request import ParsedRequest, RequestLimits, parse_request
from omnistage.services.imagegen.runner import Failed, Finished, ImageGenRunner, Job, Progress
from omnistage.v1 import imagegen_pb2


@dataclass(frozen=True)
class ImageResult:
    png: bytes
    width: int
    height: int
    seed: int
    bucket: tuple[int, int]  # (height, width) generated
    steps: int


_COUNTERS = {
    "imagegen_forwards": "DiT forwards run (one per step of a group of equal-shape requests)",
    "imagegen_forward_requests": "Requests stepped in those forwards",
    "imagegen_forward_rows": "DiT rows in those forwards (2 per request with guidance)",
    "imagegen_steps": "Denoising steps done (per request)",
    "imagegen_cancelled": "Requests dropped from the denoising loop (client left)",
    "imagegen_images": "Images generated",
}


def _counter(name: str, doc: str = ""):
    return metrics.counter(name, doc or _COUNTERS[name])


class ImageGenEngine:
    """`parse(request)` then `generate(parsed, timeout_s)` → Progress events, then one ImageResult."""

    def __init__(
        self,
        pipeline: ImagePipeline,
        cfg: ImageGenConfig,
        transport: TransportContext,
        cap: int,
        *,
        service: str = "imagegen",
        on_failure: Callable[[DeviceFailed], None] | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.cfg = cfg
        self.transport = transport
        self.service = service
        mc = pipeline.models.config
        self.limits = RequestLimits(cfg, mc.mlp.num_queries, mc.thinker_hidden, pipeline.size_multiple)
        self.limiter = ConcurrencyLimiter(
            f"{service} denoising",
            cap,
            max_waiting=cfg.max_queued_requests,
            waiting_key="imagegen.max_queued_requests",
        )
        self.runner = ImageGenRunner(pipeline, name=service, on_forward=self._count_forward)
        self.loop = DeviceLoop(service, self.runner)
        if on_failure is not None:  # the device thread died of an error: the service fails
            self.loop.on_failure.append(on_failure)
        self._pool = ThreadPoolExecutor(cfg.postprocess_workers, thread_name_prefix=f"{service}-post")
        self._holders: set[asyncio.Task] = set()

    # -- life cycle --------------------------------------------------------------------------

    def start(self) -> None:
        self.loop.start()

    def stop(self) -> None:
        self.loop.stop()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def load(self) -> tuple[int, int]:
        """(requests the device thread holds, requests waiting for a slot) for Describe."""
        return self.runner.held, self.limiter.waiting

    def export_metrics(self) -> None:
        active = metrics.gauge("imagegen_active_requests", "Requests in the denoising loop (device thread)")
        waiting = metrics.gauge("imagegen_waiting_requests", "Requests waiting for a denoising slot")
        active.labels(self.service).set_function(lambda: self.runner.held)
        waiting.labels(self.service).set_function(lambda: self.limiter.waiting)
        for name in _COUNTERS:  # exported at 0 from the start: rate() sees the first increase
            _counter(name).labels(self.service)
        # from now on (after the warm-up): clients' requests only
        self.runner.on_admit = (
            metrics.histogram(
                "imagegen_queue_time_seconds",
                "Time a request waited in the image stage: its arrival in the engine "
                "(parsed) to the device thread taking it into the denoising loop",
            )
            .labels(self.service)
            .observe
        )

    def _count_forward(self, jobs: int, rows: int) -> None:
        _counter(
            "imagegen_forwards", "DiT forwards run (one per step of a group of equal-shape requests)"
        ).labels(self.service).inc()
        _counter("imagegen_forward_requests", "Requests stepped in those forwards").labels(self.service).inc(
            jobs
        )
        _counter("imagegen_forward_rows", "DiT rows in those forwards (2 per request with guidance)").labels(
            self.service
        ).inc(rows)

    # -- requests ----------------------------------------------------------------------------

    async def parse(self, request: imagegen_pb2.ImageGenRequest) -> ParsedRequest:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, parse_request, request, self.limits, self.transport)

    async def generate(
        self, parsed: ParsedRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[Progress | ImageResult]:
        """Progress after every step, then the ImageResult. Leaving the iterator early drops the job."""
        deadline = time.monotonic() + timeout_s if timeout_s is not None else math.inf
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        admitted: asyncio.Future = loop.create_future()
        released: asyncio.Future = loop.create_future()

        def on_event(ev: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting any more
                loop.call_soon_threadsafe(events.put_nowait, ev)

        def on_release() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(lambda: released.done() or released.set_result(None))

        job = Job(parsed.spec, on_event, on_release)
        holder = asyncio.create_task(self._hold(job, deadline, admitted, released))
        self._holders.add(holder)
        holder.add_done_callback(self._holders.discard)
        ended = False  # the device thread is done with the job (finished or failed)
        try:
            await admitted
            while True:
                ev = await events.get()
                if isinstance(ev, Progress):
                    _counter("imagegen_steps", "Denoising steps done (per request)").labels(
                        self.service
                    ).inc()
                    yield ev
                elif isinstance(ev, Finished):
                    ended = True
                    yield await self._result(parsed, ev)
                    return
                elif isinstance(ev, Failed):
                    ended = True
                    raise ev.error
        finally:
            if not admitted.done() or admitted.cancelled():  # a cancelled caller's await cancels `admitted`
                holder.cancel()
            elif not ended and not admitted.cancelled() and admitted.exception() is None:
                job.cancel()  # the device thread has it: dropped at the next step boundary
                _counter(
                    "imagegen_cancelled", "Requests dropped from the denoising loop (client left)"
                ).labels(self.service).inc()

    async def _hold(
        self, job: Job, deadline: float, admitted: asyncio.Future, released: asyncio.Future
    ) -> None:
        """Take a slot, hand the job to the device thread, keep the slot until the thread lets go of it."""
        try:
            async with self.limiter.admit(
                deadline, self.cfg.queue_timeout_s, what="a denoising slot", retry_after_ms=1000
            ):
                if admitted.done():  # the caller left while this waited: the job never reaches the device
                    return
                self.loop.admit(lambda: self.runner.put(job))
                admitted.set_result(None)
                await released
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - refused, or the device loop stopped: the request learns why
            if not admitted.done():
                admitted.set_exception(exc)

    async def _result(self, parsed: ParsedRequest, ev: Finished) -> ImageResult:
        loop = asyncio.get_running_loop()
        png = await loop.run_in_executor(self._pool, images.png_bytes, ev.pixels, parsed.width, parsed.height)
        _counter("imagegen_images", "Images generated").labels(self.service).inc()
        spec = parsed.spec
        return ImageResult(png, parsed.width, parsed.height, spec.seed, spec.bucket, spec.steps)
