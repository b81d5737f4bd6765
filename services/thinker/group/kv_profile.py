"""KV-cache auto-profile: size the cache from a measured peak, then prove the size (memory_transport.md §3)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from omnistage.common.config import EngineConfig, MemoryConfig
from omnistage.common.log import get_logger
from omnistage.common.memory.device import OWN_SEGMENT_MIN_BYTES, SEGMENT_BYTES, DeviceMemory, fmt_bytes
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sampler import Sampler
from omnistage.services.thinker.group.warmup import (
    DummyShape,
    StepProgress,
    release_after_failure,
    run_dummy_step,
    stress_shapes,
)
from omnistage.services.thinker.tp.distributed import TPControl

log = get_logger(__name__)
OOM_ERRORS = (torch.OutOfMemoryError, MemoryError)


class KVProfileError(RuntimeError):
    """The KV cache could not be sized within the budget; the message names every knob (and
    `culprit_rank` the rank that could not go on, when one rank is to blame)."""

    def __init__(self, message: str, culprit_rank: int | None = None) -> None:
        super().__init__(message)
        self.culprit_rank = culprit_rank


@dataclass(frozen=True)
class KVSettings:
    """The deploy file's knobs of the auto-profile, resolved for one device."""

    # Bytes this rank may hold on its device (memory.budget_*); the device total when none is set.
    budget_bytes: int
    canary_bytes: int = 256 << 20
    safety_factor: float = 1.0
    probe_tokens: int = 0
    # engine.kv_tokens (or num_kv_blocks × block_size): skip the search, still validate the size.
    pinned_tokens: int = 0
    max_attempts: int = 4
    shrink: float = 0.95

    @classmethod
    def from_config(cls, engine: EngineConfig, memory: MemoryConfig, device_total: int) -> KVSettings:
        pinned = engine.kv_tokens or engine.num_kv_blocks * engine.block_size
        return cls(
            budget_bytes=memory.budget_of(device_total) or device_total,
            canary_bytes=engine.kv_canary_bytes,
            safety_factor=engine.kv_safety_factor,
            probe_tokens=engine.kv_probe_tokens,
            pinned_tokens=pinned,
        )


@dataclass
class KVProfile:
    """What the profile chose and measured (logged, and exported through Describe's MemoryReport)."""

    num_blocks: int
    block_bytes: int
    cap_bytes: int  # min(budget, total − peers): what this rank may reserve
    peers_bytes: int
    weights_bytes: int
    activation_peak_bytes: int  # largest stress step's own allocations (activations, logits, sampler)
    peak_reserved_bytes: int  # reserved at max load after the rebuild, canary excluded
    canary_bytes: int
    attempts: int
    pinned: bool
    proposed_blocks: int = 0  # what this rank alone would have taken (the group took the MIN)
    shape_peaks: dict[str, int] = field(default_factory=dict)
    phase_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def headroom_bytes(self) -> int:
        return self.cap_bytes - self.peak_reserved_bytes

    def summary(self) -> str:
        return (
            f"KV cache {self.num_blocks} blocks ({fmt_bytes(self.kv_bytes)}), "
            f"{'pinned' if self.pinned else f'chosen in {self.attempts} attempt(s)'}; budget {fmt_bytes(self.cap_bytes)} "
            f"(peers hold {fmt_bytes(self.peers_bytes)}), weights {fmt_bytes(self.weights_bytes)}, "
            f"activation peak {fmt_bytes(self.activation_peak_bytes)}, peak at max load "
            f"{fmt_bytes(self.peak_reserved_bytes)}, headroom {fmt_bytes(self.headroom_bytes)} "
            f"(canary {fmt_bytes(self.canary_bytes)} proven free)"
        )


def peers_bytes(mem: DeviceMemory) -> int:
    """Device memory held by others now (peer processes, CUDA context, NCCL): total − free − ours."""
    return max(0, mem.total() - mem.free() - mem.reserved())


def enforce_cap(mem: DeviceMemory, cap: int) -> None:
    """Make the allocator refuse to reserve past `cap` for this rank (an OOM instead of eating a
    peer's memory). A simulated device counts its other holders inside its limit, so add them."""
    set_limit = getattr(mem, "set_limit", None)
    if set_limit is not None:
        set_limit(cap + int(getattr(mem, "reserved_elsewhere", lambda: 0)()))


def knobs_message(
    what: str, runner: ModelRunner, settings: KVSettings, cap: int, peers: int, extra: str = ""
) -> str:
    cfg = runner.cfg
    need_one = -(-runner.requested_max_model_len // cfg.block_size) * runner.kv_block_bytes()
    return (
        f"{what}. Knobs: memory budget {fmt_bytes(cap)} usable (memory.budget_bytes / memory.budget_fraction "
        f"= {fmt_bytes(settings.budget_bytes)}, peers hold {fmt_bytes(peers)}); engine.max_num_seqs="
        f"{cfg.max_num_seqs}; engine.max_num_batched_tokens={cfg.max_num_batched_tokens}; engine.max_model_len="
        f"{runner.requested_max_model_len} (one such request needs {fmt_bytes(need_one)} of KV); CUDA graph "
        f"sizes: none (not captured yet); engine.kv_safety_factor={settings.safety_factor}; "
        f"engine.kv_canary_bytes={settings.canary_bytes}; set engine.kv_tokens to pin a KV size (skips the "
        f"search){'; ' + extra if extra else ''}"
    )


class _Profiler:
    """One run of the auto-profile on one rank (all ranks run it in lockstep)."""

    def __init__(
        self,
        runner: ModelRunner,
        control: TPControl,
        mem: DeviceMemory,
        settings: KVSettings,
        peers_at_start: int,
        progress: StepProgress | None,
        sampler: Sampler | None,
    ) -> None:
        self.runner, self.control, self.mem, self.settings = runner, control, mem, settings
        self.progress = progress
        self.sampler = sampler or Sampler()
        self.shapes: list[DummyShape] = stress_shapes(runner.cfg)
        self.block_bytes = runner.kv_block_bytes()
        self.min_blocks = -(-runner.requested_max_model_len // runner.cfg.block_size)
        self.peers = max(peers_at_start, peers_bytes(mem))
        self.cap = min(settings.budget_bytes, mem.total() - self.peers)
        self.times: dict[str, float] = {}
        self.shape_peaks: dict[str, int] = {}
        self.proposal = 0

    # -- helpers ---------------------------------------------------------------------------
    def _progress(self, detail: str, done: int = 0, total: int = 0) -> None:
        log.info("profiling memory: %s", detail)
        if self.progress is not None:
            self.progress(detail, done, total)

    def _fail(self, what: str, extra: str = "", culprit_rank: int | None = None) -> KVProfileError:
        message = knobs_message(what, self.runner, self.settings, self.cap, self.peers, extra)
        return KVProfileError(message, culprit_rank)

    def _agree(self, why_not: str, what: str) -> tuple[bool, int]:
        if why_not:
            log.warning("rank %d: %s", self.control.rank, why_not)
        return self.control.agree_all(not why_not, what)

    def _try(self, fn: Callable[[], object]) -> str:
        """Run a local allocation; an OOM becomes a reason string (decided on together, not here)."""
        try:
            fn()
        except OOM_ERRORS as exc:
            reason = f"{type(exc).__name__}: {exc}"
        else:
            return ""
        release_after_failure(self.mem)
        return reason

    def _stress(self, label: str) -> tuple[int, str]:
        """Run every stress shape; returns (peak reserved, failure). A failure with peers is fatal."""
        peak = self.mem.reserved()
        for shape in self.shapes:
            self.mem.reset_peak()
            before = self.mem.allocated()
            failure = ""
            try:
                run_dummy_step(self.runner, shape, self.sampler)
            except OOM_ERRORS as exc:
                if self.control.is_distributed:  # peers wait inside this forward's collectives
                    failure = self.control.fail(f"profiling memory ({label} {shape.name!r})", exc).message
                else:
                    failure = f"{label} {shape.name!r}: {type(exc).__name__}: {exc}"
            except Exception as exc:
                failure = self.control.fail(f"profiling memory ({label} {shape.name!r})", exc).message
                raise KVProfileError(failure) from None
            if failure:
                release_after_failure(self.mem)
                if self.control.is_distributed:
                    raise self._fail(f"auto-profile: {failure}")
                return peak, failure
            self.shape_peaks[shape.name] = max(
                self.shape_peaks.get(shape.name, 0), self.mem.peak_allocated() - before
            )
            peak = max(peak, self.mem.peak_reserved())
        return peak, ""

    def _canary(self) -> torch.Tensor:
        return torch.empty(self.settings.canary_bytes, dtype=torch.uint8, device=self.runner.device)

    # -- the phases ------------------------------------------------------------------------
    def _remeasure_peers(self) -> None:
        """What is held outside our allocator grows with the first forwards (NCCL's communicator
        buffers, the CUDA context's kernels and library handles: ~1.5 GiB per rank on an H200 at
        TP=2). Measured before them, the cap promised memory the device no longer had: without a
        budget, a validation step ran out of device memory inside a TP forward. Re-measured after
        the probe stress, the cap is what this rank can really reserve."""
        peers = peers_bytes(self.mem)
        if peers > self.peers:
            log.info(
                "auto-profile: memory held outside this allocator grew to %s during the probe stress",
                fmt_bytes(peers),
            )
            self.peers = peers
            self.cap = min(self.settings.budget_bytes, self.mem.total() - self.peers)
            enforce_cap(self.mem, self.cap)

    def probe(self) -> int:
        """Probe KV → stress → MIN-agreed target block count."""
        started = time.monotonic()
        bs = self.runner.cfg.block_size
        probe_blocks = max(-(-self.settings.probe_tokens // bs), *(s.blocks_needed(bs) for s in self.shapes))
        self._progress(f"probe: {probe_blocks} KV blocks")
        why = self._try(lambda: self.runner.allocate_kv(probe_blocks))
        ok, bad = self._agree(why, "agreeing on the probe KV cache")
        if not ok:
            raise self._fail(
                f"rank {bad} cannot hold the weights plus a probe KV cache of {probe_blocks} blocks", why, bad
            )
        probe_kv = self.runner.kv_bytes()
        self._progress("stress: largest prefill and decode (sampler included)")
        peak, failure = self._stress("probe stress")
        if failure:
            raise self._fail(f"auto-profile: the stress at the probe size does not fit: {failure}")
        self.times["probe_stress_s"] = time.monotonic() - started
        self._remeasure_peers()
        non_kv = max(0, peak - probe_kv)
        canary = self.settings.canary_bytes
        # Two limits, both the ones the rebuild is then held to: the peak reserved at max load stays
        # within the cap, and after KV + canary the cap still has the largest step's measured peak
        # free. The second also covers what a first forward leaves allocated for good (cuBLAS
        # workspaces: allocated once, counted in the peak of the step that made them).
        kept = self.mem.allocated() - probe_kv  # weights and whatever stays when the KV cache goes
        largest_step = max(self.shape_peaks.values(), default=0)
        # The peak at the chosen size may round one segment above the probe's (one H200: 10 MiB
        # over, attempt 1 failed its own check before the 5 % shrink).
        by_peak = self.cap - non_kv - canary - self.mem.segment_bytes
        by_free = self.cap - kept - canary - largest_step - SEGMENT_BYTES  # a segment of rounding
        target = min(by_peak, by_free) * self.settings.safety_factor
        proposal = self.proposal = max(0, int(target // self.block_bytes))
        log.info(
            "auto-profile measure: peak reserved %s with probe KV %s → non-KV %s; kept %s, largest step %s; "
            "cap %s, canary %s → %d blocks",
            fmt_bytes(peak),
            fmt_bytes(probe_kv),
            fmt_bytes(non_kv),
            fmt_bytes(kept),
            fmt_bytes(largest_step),
            fmt_bytes(self.cap),
            fmt_bytes(canary),
            proposal,
        )
        self._progress(f"agree: this rank proposes {proposal} blocks")
        blocks = self.control.agree_min(proposal, "agreeing on the KV cache size")
        if blocks < self.min_blocks:
            raise self._fail(
                f"auto-profile: only {blocks} KV blocks fit (non-KV peak {fmt_bytes(non_kv)}), one "
                f"max_model_len request needs {self.min_blocks}"
            )
        self.teardown(probe_kv)
        return blocks

    def teardown(self, kv_bytes: int) -> None:
        """Free the KV cache and everything bound to it; reserved memory must really drop."""
        before = self.mem.reserved()
        self.runner.free_kv()
        release_after_failure(self.mem)
        dropped = before - self.mem.reserved()
        why = ""
        # Allocators round to segments; a cache small enough to share its segment proves nothing.
        if kv_bytes > OWN_SEGMENT_MIN_BYTES and dropped < kv_bytes - SEGMENT_BYTES:
            why = (
                f"tearing down the KV cache released {fmt_bytes(dropped)} of reserved memory, expected at "
                f"least {fmt_bytes(kv_bytes)}: something still references the old cache (layer k_cache/"
                f"v_cache views, a KV user of the model runner, a graph, a dummy request)"
            )
        ok, bad = self._agree(why, "agreeing on the KV teardown")
        if not ok:
            raise KVProfileError(
                f"rank {bad}: {why}" if why else f"rank {bad} could not release its KV cache", bad
            )

    def rebuild_and_validate(self, blocks: int, pinned: bool) -> KVProfile:
        """Rebuild at `blocks`, prove the canary, validate; shrink 5 % and retry (not when pinned)."""
        attempts = 1 if pinned else self.settings.max_attempts
        failures: list[str] = []
        bad = self.control.world_size
        for attempt in range(1, attempts + 1):
            tag = f"attempt {attempt}/{attempts}"
            started = time.monotonic()
            ok, bad, why, peak, canary = self._attempt(blocks, pinned, attempt, attempts)
            self.times[f"attempt{attempt}_s"] = time.monotonic() - started
            if ok:
                return self._result(blocks, pinned, attempt, peak, canary)
            failures.append(f"{tag} at {blocks} blocks: rank {bad}: {why or 'not ready'}")
            log.warning("auto-profile %s failed on rank %d: %s", tag, bad, why or "(another rank)")
            # Every rank tears down, with or without a cache (one whose rebuild failed has none):
            # the teardown's agreement is a collective, so it must never depend on local state.
            self.teardown(self.runner.kv_bytes())
            blocks = int(blocks * self.settings.shrink)
            if attempt < attempts and blocks < self.min_blocks:
                failures.append(
                    f"shrinking leaves {blocks} blocks, below one max_model_len request ({self.min_blocks})"
                )
                break
        what = (
            "pinned KV size does not fit"
            if pinned
            else f"auto-profile failed after {len(failures)} attempt(s)"
        )
        raise self._fail(what, "; ".join(failures), bad if bad < self.control.world_size else None)

    def _attempt(
        self, blocks: int, pinned: bool, attempt: int, attempts: int
    ) -> tuple[bool, int, str, int, int]:
        """One try at `blocks`: allocate, prove the canary, check the room left, validate, each agreed by
        every rank. Returns (ok, the rank that could not, why, peak reserved, canary bytes counted)."""
        tag = f"attempt {attempt}/{attempts}"
        self._progress(f"rebuild: {blocks} blocks ({tag})", attempt, attempts)
        why = self._try(lambda b=blocks: self.runner.allocate_kv(b))
        if pinned:  # a pinned cache smaller than max_model_len caps it: stress what will be served
            self.shapes = stress_shapes(self.runner.cfg)
        canary: list[torch.Tensor] = []
        if not why and self.settings.canary_bytes:
            self._progress(f"canary: {fmt_bytes(self.settings.canary_bytes)} ({tag})", attempt, attempts)
            why = self._try(lambda c=canary: c.append(self._canary()))
        if not why and self.shape_peaks:
            need = max(self.shape_peaks.values())
            free = self.cap - self.mem.allocated()
            if free < need:
                why = f"{fmt_bytes(free)} left in the budget, the largest stress step needs {fmt_bytes(need)}"
        ok, bad = self._agree(why, f"agreeing on the KV rebuild ({tag})")
        # The canary has proven its bytes allocatable; it is freed (and its segment returned)
        # before the validation stress, which must then leave it free: peak + canary <= budget.
        # Held during the stress, it left no cushion: a step that needs a little more than the
        # probe measured (rounding next to a cache of ~100 GiB: 16 MiB on 2 x H200 in fp32) ran
        # out of memory inside a TP forward, which is fatal to the group; measured, the same
        # overshoot is agreed on and shrinks the cache like any other.
        counted_canary = sum(t.numel() for t in canary)
        canary.clear()
        if counted_canary:
            release_after_failure(self.mem)
        peak = 0
        if ok:
            self._progress(f"validate: stress at {blocks} blocks ({tag})", attempt, attempts)
            self.mem.reset_peak()
            peak, why = self._stress(f"validation ({tag})")
            if not why and peak + counted_canary > self.cap:
                why = (
                    f"peak reserved {fmt_bytes(peak)} leaves less than the canary "
                    f"({fmt_bytes(counted_canary)}) of the budget {fmt_bytes(self.cap)}"
                )
            ok, bad = self._agree(why, f"agreeing on the validation ({tag})")
        return ok, bad, why, peak, counted_canary

    def _result(self, blocks: int, pinned: bool, attempt: int, peak: int, canary: int) -> KVProfile:
        return KVProfile(
            num_blocks=blocks,
            block_bytes=self.block_bytes,
            cap_bytes=self.cap,
            peers_bytes=self.peers,
            weights_bytes=self.runner.weights_bytes(),
            activation_peak_bytes=max(self.shape_peaks.values(), default=0),
            peak_reserved_bytes=peak,
            canary_bytes=canary,
            attempts=attempt,
            pinned=pinned,
            proposed_blocks=self.proposal or blocks,
            shape_peaks=dict(self.shape_peaks),
            phase_seconds=dict(self.times),
        )


def size_kv_cache(
    runner: ModelRunner,
    control: TPControl,
    mem: DeviceMemory,
    settings: KVSettings,
    *,
    peers_at_start: int = 0,
    progress: StepProgress | None = None,
    sampler: Sampler | None = None,
) -> KVProfile:
    """Choose, build and validate this rank's KV cache (all ranks end with the same block count).

    The caller runs this with the model loaded, no KV cache yet, inside `mem.meter()`. The budget
    becomes a hard limit of the allocator (`set_limit`), so nothing of this rank grows past it later.
    """
    prof = _Profiler(runner, control, mem, settings, peers_at_start, progress, sampler)
    enforce_cap(mem, prof.cap)
    started = time.monotonic()
    if settings.pinned_tokens:
        bs = runner.cfg.block_size
        blocks = control.agree_min(-(-settings.pinned_tokens // bs), "agreeing on the pinned KV size")
        result = prof.rebuild_and_validate(blocks, pinned=True)
    else:
        result = prof.rebuild_and_validate(prof.probe(), pinned=False)
    result.phase_seconds["total_s"] = time.monotonic() - started
    runner.budget_bytes, runner.activation_peak_bytes = result.cap_bytes, result.activation_peak_bytes
    log.info("auto-profile: %s", result.summary())
    return result
