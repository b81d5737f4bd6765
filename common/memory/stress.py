"""Stress-and-cap for stages without a KV cache (encoders, talker, DiT)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from omnistage.common.log import get_logger, log_fields
from omnistage.common.memory.device import DeviceMemory
from omnistage.common.memory.units import fmt_bytes
from omnistage.v1 import control_pb2

log = get_logger(__name__)


class StressError(RuntimeError):
    """No candidate batch fits; the message lists every attempt and the knobs to change."""


@dataclass(frozen=True)
class StressAttempt:
    batch: int
    fits: bool
    peak_reserved: int  # bytes this process had reserved at the attempt's high-water mark
    reason: str  # "fits", or why not (the OOM message, or the budget it exceeded)


@dataclass(frozen=True)
class StressResult:
    """What the stage tested; `max_batch` is the runtime concurrency cap."""

    stage: str
    device: str
    configured_max: int
    max_batch: int
    attempts: tuple[StressAttempt, ...]
    budget_bytes: int
    baseline_reserved: int  # reserved before the stress (weights and buffers)
    peak_reserved: int  # high-water mark of the batch that fit
    reserved_after: int  # still reserved now: the kept peak

    @property
    def activation_peak_bytes(self) -> int:
        return max(self.peak_reserved - self.baseline_reserved, 0)

    def why(self) -> str:
        """One line per attempt, for logs and failure messages."""
        return "; ".join(
            f"batch {a.batch}: {a.reason} (peak reserved {fmt_bytes(a.peak_reserved)})" for a in self.attempts
        )

    def memory_report(
        self, weights_bytes: int = 0, transport_pool_bytes: int = 0
    ) -> control_pb2.MemoryReport:
        """The stage's footprint for Describe / metrics (weights as measured by the caller)."""
        return control_pb2.MemoryReport(
            device=self.device,
            budget_bytes=self.budget_bytes,
            weights_bytes=weights_bytes,
            activation_peak_bytes=self.activation_peak_bytes,
            transport_pool_bytes=transport_pool_bytes,
            total_bytes=self.reserved_after + transport_pool_bytes,
        )


class StressAndCap:
    """Find the largest candidate batch `run_batch(batch)` survives on `mem`, and keep its peak reserved.

    `run_batch` must run the stage's real work at that batch with its largest configured
    resolution/length (and everything a request allocates: pre- and post-processing included).
    """

    def __init__(
        self,
        stage: str,
        mem: DeviceMemory,
        run_batch: Callable[[int], object],
        candidates: Sequence[int],
        *,
        budget_bytes: int = 0,
        logger: logging.Logger | None = None,
    ) -> None:
        sizes = sorted({int(b) for b in candidates}, reverse=True)
        if not sizes or sizes[-1] < 1:
            raise ValueError(f"{stage}: stress candidates must be batch sizes >= 1, got {list(candidates)}")
        self.stage = stage
        self.mem = mem
        self.run_batch = run_batch
        self.candidates = sizes
        self.budget_bytes = budget_bytes
        self.log = logger or log

    def _attempt(self, batch: int) -> StressAttempt:
        self.mem.reset_peak()
        allocated_before = self.mem.allocated()
        oom = ""
        try:
            with self.mem.meter():
                out = self.run_batch(batch)
                del out  # outputs are not part of what stays reserved
        except torch.OutOfMemoryError as exc:
            oom = f"out of memory: {str(exc).splitlines()[0]}"
        # Out of the except block: the traceback's frames, and the tensors they held, are gone.
        peak = self.mem.peak_reserved()
        if self.mem.allocated() > allocated_before:
            # Only tensors in reference cycles are left: collect them. A full collection costs a
            # second or more in a process with a model loaded, so not when nothing is held.
            gc.collect()
        if oom:
            self.mem.empty_cache()  # give back what the failed attempt grew; the next one measures cleanly
            return StressAttempt(batch, False, peak, oom)
        if self.budget_bytes and peak > self.budget_bytes:
            self.mem.empty_cache()
            return StressAttempt(
                batch, False, peak, f"peak over the budget of {fmt_bytes(self.budget_bytes)}"
            )
        return StressAttempt(batch, True, peak, "fits")

    def _logged_attempt(self, batch: int) -> StressAttempt:
        attempt = self._attempt(batch)
        log_fields(
            self.log,
            logging.INFO if attempt.fits else logging.WARNING,
            "stress attempt",
            stage=self.stage,
            batch=batch,
            fits=attempt.fits,
            reason=attempt.reason,
            peak_reserved=attempt.peak_reserved,
        )
        return attempt

    def run(self) -> StressResult:
        """Try candidates largest first; the first that fits is the cap. Raises StressError if none fits."""
        baseline = self.mem.reserved()
        attempts: list[StressAttempt] = []
        for batch in self.candidates:
            attempts.append(self._logged_attempt(batch))
            if attempts[-1].fits:
                break
        fitting = [a for a in attempts if a.fits]
        # a MAX: the largest batch proven safe
        return self._concluded(baseline, attempts, max((a.batch for a in fitting), default=0))

    def prove(self) -> StressResult:
        """Where there is no device memory to prove (a plain CPU, `StartupConfig.full_warmup` false): no
        budget can refuse a batch there, so `run` could only conclude the largest candidate. One attempt
        at the smallest candidate proves the stage's largest shapes run; the cap is the largest
        candidate (raises StressError if even that attempt runs out of memory)."""
        baseline = self.mem.reserved()
        attempt = self._logged_attempt(self.candidates[-1])
        return self._concluded(baseline, [attempt], self.candidates[0] if attempt.fits else 0)

    def take_largest(self) -> StressResult:
        """Nothing run (no device memory to prove, as `prove`): the largest candidate, for a stage whose
        next start-up step runs that batch anyway (the talker's serving runner)."""
        return self._concluded(self.mem.reserved(), [], self.candidates[0])

    def _concluded(self, baseline: int, attempts: list[StressAttempt], max_batch: int) -> StressResult:
        """The result of `attempts` with cap `max_batch` (0: StressError), logged."""
        fitting = [a for a in attempts if a.fits]
        result = StressResult(
            stage=self.stage,
            device=self.mem.device_name,
            configured_max=self.candidates[0],
            max_batch=max_batch,
            attempts=tuple(attempts),
            budget_bytes=self.budget_bytes,
            baseline_reserved=baseline,
            peak_reserved=fitting[-1].peak_reserved if fitting else baseline,
            reserved_after=self.mem.reserved(),
        )
        if not max_batch:
            raise StressError(
                f"{self.stage}: no batch size fits on {result.device} "
                f"(free {fmt_bytes(self.mem.free())} of {fmt_bytes(self.mem.total())}"
                f"{', budget ' + fmt_bytes(self.budget_bytes) if self.budget_bytes else ''}): {result.why()}. "
                "Lower the stage's largest batch/resolution, raise memory.budget_bytes / budget_fraction, "
                "or move the stage to a GPU with more free memory."
            )
        if result.max_batch < result.configured_max:
            self.log.warning(
                "%s: concurrency capped at %d of configured %d on %s: %s",
                self.stage,
                result.max_batch,
                result.configured_max,
                result.device,
                result.why(),
            )
        elif not any(a.batch == max_batch for a in fitting):
            self.log.info(
                "%s: batch %d taken on %s without a memory run (no device memory to prove; %s)",
                self.stage,
                result.max_batch,
                result.device,
                result.why() or "nothing run",
            )
        else:
            self.log.info(
                "%s: batch %d fits on %s (peak reserved %s, kept reserved)",
                self.stage,
                result.max_batch,
                result.device,
                fmt_bytes(result.peak_reserved),
            )
        return result
