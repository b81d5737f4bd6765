"""One thinker rank's start-up, the same on every rank: join the group → load → size KV → warm up."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Protocol

import torch
from omnistage.common.config import (
    DeployConfig,
    EngineConfig,
    FaultConfig,
    MemoryConfig,
    ServiceConfig,
    TPConfig,
)
from omnistage.common.log import get_logger
from omnistage.common.memory.device import DeviceMemory, device_memory_for
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs, graph_reserve_bytes
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.model_runner import ModelRunner, to_dtype
from omnistage.services.thinker.group.faults import StartupFault
from omnistage.services.thinker.group.kv_profile import KVProfile, KVSettings, peers_bytes, size_kv_cache
from omnistage.services.thinker.group.warmup import WarmupResult, run_warmup, warmup_shapes
from omnistage.services.thinker.models.bailing_moe_v2 import BailingMoeV2ForCausalLM
from omnistage.services.thinker.models.layers.backends import (
    BackendError,
    Backends,
    install_backends,
    resolve_backends,
)
from omnistage.services.thinker.models.loader import load_model
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.services.thinker.tp.distributed import GroupFailure, TPControl, TPError, join_tp_group

log = get_logger(__name__)

# How a TP group captures decode graphs: aligned (default) | off | unaligned (diagnosis only).
TP_GRAPHS_ENV = "OMNISTAGE_TP_CUDA_GRAPHS"


def tp_graph_capture() -> str:
    """How a TP group captures its decode graphs: `aligned` (the ranks agree on each size once their
    devices are idle, and on the end), `off` (the group decodes eagerly) or `unaligned` (each rank on
    its own: the mode in which one rank stuck once on 4 x H100, kept to diagnose that)."""
    mode = os.environ.get(TP_GRAPHS_ENV, "aligned").strip().lower() or "aligned"
    if mode not in ("off", "aligned", "unaligned"):
        raise ValueError(f"{TP_GRAPHS_ENV}={mode!r}: expected off, aligned or unaligned")
    return mode


@dataclass(frozen=True)
class RankConfig:
    """Everything one thinker rank needs to start, resolved once (from the deploy file, or by tests)."""

    checkpoint: str
    engine: EngineConfig = field(default_factory=EngineConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    tp: TPConfig = field(default_factory=TPConfig)
    load_format: str = "safetensors"
    dtype: str = "float32"
    device: str = "cpu"  # this rank's device ("cuda:3")
    rank: int = 0
    world_size: int = 1
    host: str = "127.0.0.1"
    dist_port: int = 0
    warmup: bool = True
    # Test hook (services.<name>.fault with `at`): an out-of-memory at one point of start-up.
    fault: FaultConfig | None = None

    @classmethod
    def from_deploy(cls, cfg: DeployConfig, svc: ServiceConfig, rank: int) -> RankConfig:
        return cls(
            checkpoint=cfg.model.checkpoint,
            load_format=cfg.model.load_format,
            engine=svc.engine,
            memory=svc.memory,
            tp=svc.tp,
            dtype=svc.dtype,
            device=device_of(svc, rank),
            rank=rank,
            world_size=svc.tp_size,
            host=cfg.host,
            dist_port=svc.dist_port,
            fault=svc.fault if svc.fault is not None and svc.fault.at else None,
        )

    def for_rank(self, rank: int) -> RankConfig:
        """The same deployment seen from `rank` (CUDA: one GPU per rank, `cuda:<rank>`)."""
        device = self.device if self.device == "cpu" else f"cuda:{rank}"
        return dataclasses.replace(self, rank=rank, device=device)


def device_of(svc: ServiceConfig, rank: int) -> str:
    if svc.device == "cpu":
        return "cpu"
    gpus = svc.gpus or tuple(range(svc.tp_size))
    return f"cuda:{gpus[rank]}"


class StartupProgress(Protocol):
    """Where start-up reports (the service's phase reporter; a log line in tests and benchmarks)."""

    def enter(self, phase: str, total: int = 0, unit: str = "") -> None: ...
    def step(self, detail: str, done: int = 0, total: int = 0) -> None: ...
    def failed(self, failure: GroupFailure) -> None: ...


class LogProgress:
    """StartupProgress that logs (tests, benchmarks)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank

    def enter(self, phase: str, total: int = 0, unit: str = "") -> None:
        log.info("rank %d: phase %s", self.rank, phase)

    def step(self, detail: str, done: int = 0, total: int = 0) -> None:
        log.info("rank %d: %s%s", self.rank, detail, f" ({done}/{total})" if total else "")

    def failed(self, failure: GroupFailure) -> None:
        log.error("rank %d: start-up failed: %s", self.rank, failure.message)


class StartupError(TPError):
    """Start-up failed on some rank; the message is the group's first failure."""


@dataclass
class StartedRank:
    """A rank ready to serve: its runner and group, (rank 0) the tokenizer, what start-up measured."""

    cfg: RankConfig
    runner: ModelRunner
    control: TPControl
    tokenizer: MingTokenizer | None
    mem: DeviceMemory | None
    kv_profile: KVProfile | None = None
    warmup: WarmupResult | None = None
    phase_seconds: dict[str, float] = field(default_factory=dict)
    load_peak_bytes: int = 0  # the device's peak while loading the weights (0 without an accountant)

    def summary(self) -> dict:
        """What start-up chose and how long each phase took (logged as one JSON line)."""
        prof = self.kv_profile
        return {
            "rank": self.cfg.rank,
            "phase_seconds": self.phase_seconds,
            "kv_blocks": self.runner.num_kv_blocks,
            "kv_tokens": self.runner.num_kv_blocks * self.runner.cfg.block_size,
            "kv_bytes": self.runner.kv_bytes(),
            "weights_bytes": self.runner.weights_bytes(),
            "load_peak_bytes": self.load_peak_bytes,
            "kv_attempts": prof.attempts if prof else 0,
            "activation_peak_bytes": prof.activation_peak_bytes if prof else 0,
            "budget_bytes": prof.cap_bytes if prof else 0,
            "warmup_skipped": self.warmup.skipped if self.warmup else [],
        }


def start_rank(cfg: RankConfig, progress: StartupProgress | None = None) -> StartedRank:
    """Join the TP group and start this rank; raises StartupError naming the group's first failure."""
    progress = progress or LogProgress(cfg.rank)
    unit = "shards" if cfg.load_format == "safetensors" else "layers"
    progress.enter("loading_weights", 0, unit)  # the rendezvous waits for the slowest rank's start
    joined = time.monotonic()
    try:
        control = join_tp_group(cfg.rank, cfg.world_size, cfg.host, cfg.dist_port, cfg.device, cfg.tp)
    except TPError as exc:  # the rendezvous itself failed: no group to tell
        raise StartupError(exc.failure) from exc
    control.add_failure_listener(progress.failed)
    startup = _Startup(cfg, control, progress)
    startup.seconds["rendezvous"] = time.monotonic() - joined
    try:
        started = startup.run()
    except Exception as exc:
        raise StartupError(
            control.fail(control.where, exc, culprit=getattr(exc, "culprit_rank", None))
        ) from exc
    log.info("start-up done: %s", json.dumps(started.summary()))  # one line per rank, for benchmarks
    return started


def rank0_engine(started: StartedRank) -> LLMEngine:
    """Rank 0 after start-up: the step engine around its runner, tokenizer and TP group."""
    if started.tokenizer is None:
        raise ValueError(
            f"LLMEngine runs on rank 0 only (got rank {started.cfg.rank}); other ranks run the plan loop"
        )
    tok = started.tokenizer
    return LLMEngine(started.runner, tok, list(tok.stop_token_ids), started.control)


class _Startup:
    """The steps of one rank's start-up, in order (state shared between them lives here)."""

    def __init__(self, cfg: RankConfig, control: TPControl, progress: StartupProgress) -> None:
        self.cfg, self.control, self.progress = cfg, control, progress
        self.fault = StartupFault(cfg.fault, cfg.rank)
        self.phase = "loading_weights"
        control.set_phase(self.phase)
        self.runner: ModelRunner | None = None
        self.mem: DeviceMemory | None = None
        self.load_peak_bytes = 0
        self.seconds: dict[str, float] = {}
        self._phase_started = time.monotonic()

    def enter(self, phase: str, total: int = 0, unit: str = "") -> None:
        now = time.monotonic()
        self.seconds[self.phase] = now - self._phase_started
        self.phase, self._phase_started = phase, now
        self.control.set_phase(phase)
        self.progress.enter(phase, total, unit)

    def step(self, detail: str, done: int = 0, total: int = 0) -> None:
        self.progress.step(detail, done, total)
        self.fault.on_step(self.phase, detail, self.runner, self.mem)

    def run(self) -> StartedRank:
        cfg = self.cfg
        tokenizer = MingTokenizer(cfg.checkpoint) if cfg.rank == 0 else None  # fails fast, before the weights
        dev = torch.device(cfg.device)
        if dev.type == "cuda" or cfg.memory.simulated_capacity_bytes:
            self.mem = device_memory_for(str(dev), cfg.memory.simulated_capacity_bytes or None)
        self.fault.check_device(self.mem)
        mem = self.mem
        peers_at_start = peers_bytes(mem) if mem is not None else 0
        prof: KVProfile | None = None
        warm: WarmupResult | None = None
        with mem.meter() if mem is not None else contextlib.nullcontext():
            model = self.load_weights()
            backends = self.install_backends(model)
            graphs = cfg.engine.cuda_graphs and dev.type == "cuda" and backends.graph_safe
            self.tp_graphs = tp_graph_capture() if cfg.world_size > 1 else "off"  # read once, refused early
            if graphs and cfg.world_size > 1 and self.tp_graphs == "off":
                log.warning(
                    "engine.cuda_graphs: %s=off: the TP group (tp %d) decodes eagerly",
                    TP_GRAPHS_ENV,
                    cfg.world_size,
                )
                graphs = False
            self.enter("profiling_memory", unit="attempts")
            if mem is None:
                blocks = self.control.agree_min(
                    resolve_engine_config(cfg.engine).num_kv_blocks, "agreeing on KV blocks"
                )
                self.runner = ModelRunner(
                    model, resolve_engine_config(cfg.engine, blocks), cfg.device, cfg.rank
                )
            else:
                one_request = -(-cfg.engine.max_model_len // cfg.engine.block_size)
                limits = resolve_engine_config(cfg.engine, one_request)  # as configured; no cache yet
                self.runner = ModelRunner(model, limits, cfg.device, cfg.rank, allocate=False)
                settings = KVSettings.from_config(cfg.engine, cfg.memory, mem.total())
                if graphs:  # the graphs' pool is kept free like the canary (and proven so)
                    reserve = graph_reserve_bytes(self.graph_batch(), model.lm_head.rows, cfg.world_size)
                    settings = dataclasses.replace(settings, canary_bytes=settings.canary_bytes + reserve)
                prof = size_kv_cache(
                    self.runner,
                    self.control,
                    mem,
                    settings,
                    peers_at_start=peers_at_start,
                    progress=self.step,
                )
            if cfg.warmup:
                self.enter("warming_up", unit="shapes")
                warm = run_warmup(
                    self.runner,
                    self.control,
                    warmup_shapes(self.runner.cfg),
                    mem=mem,
                    cap_bytes=prof.cap_bytes if prof else 0,
                    need_bytes=prof.shape_peaks if prof else None,
                    progress=self.step,
                )
            if graphs:
                self.enter("capturing_graphs", unit="graphs")
                self.capture_graphs()
        self.seconds[self.phase] = time.monotonic() - self._phase_started
        self.control.enter_serving()
        seconds = {k: round(v, 3) for k, v in self.seconds.items()}
        return StartedRank(
            cfg, self.runner, self.control, tokenizer, mem, prof, warm, seconds, self.load_peak_bytes
        )

    def install_backends(self, model: BailingMoeV2ForCausalLM) -> Backends:
        """The deploy file's kernel choice, resolved for this device and installed in the model."""
        e = self.cfg.engine
        try:
            backends = resolve_backends(
                e.attention_backend,
                e.moe_backend,
                torch.device(self.cfg.device),
                e.block_size,
                model.config.head_dim,
            )
        except BackendError as exc:
            raise StartupError(self.control.fail("choosing kernels", exc)) from exc
        install_backends(model, backends)
        log.info("kernels: attention %s, moe %s", backends.attention, backends.moe)
        return backends

    def graph_batch(self) -> int:
        e = self.cfg.engine
        return min(e.cuda_graph_max_batch or e.max_num_seqs, e.max_num_seqs)

    def capture_graphs(self) -> None:
        """Every rank captures the same sizes (each replays what rank 0's plan says); a failure on
        any rank fails the group with its diagnostic, like a failed warm-up forward."""
        runner = self.runner
        graphs = DecodeGraphs(runner.model, self.graph_batch(), runner.cfg.max_blocks_per_seq, runner.device)
        align = self.align_capture if self.tp_graphs == "aligned" else None
        try:
            graphs.capture(progress=lambda detail, done, total: self.step(detail, done, total), align=align)
            if align is not None:  # a rank stuck in its last capture is named by the others' deadline
                self.control.agree_min(0, "captured every decode graph")
        except Exception as exc:
            raise StartupError(self.control.fail("capturing decode graphs", exc)) from exc
        runner.use_graphs(graphs)
        self.control.on_close(graphs.release)  # before the group is destroyed (see DecodeGraphs.release)

    def align_capture(self, size: int) -> None:
        """Every rank is about to capture `size` (a rank with another size, or gone, fails the group)."""
        agreed = self.control.agree_min(size, f"capturing decode graph batch {size}")
        if agreed != size:
            raise RuntimeError(f"rank {self.cfg.rank} captures batch {size} while a peer captures {agreed}")

    def load_weights(self) -> BailingMoeV2ForCausalLM:
        cfg = self.cfg
        unit = "shards" if cfg.load_format == "safetensors" else "layers"

        def shards(done: int, total: int) -> None:
            self.step(
                f"{done}/{total} {unit}" + (" (dummy weights)" if cfg.load_format == "dummy" else ""),
                done,
                total,
            )

        model = load_model(
            cfg.checkpoint,
            dtype=to_dtype(cfg.dtype),
            device=cfg.device,
            tp_rank=cfg.rank,
            tp_size=cfg.world_size,
            progress=shards,
            load_format=cfg.load_format,
        )
        if self.mem is not None:
            self.load_peak_bytes = self.mem.peak_allocated()
            self.mem.empty_cache()  # loading's temporaries must not count as the profile's peak
        return model
