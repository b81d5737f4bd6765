"""One thinker rank's start-up, the same on every rank: join the group → load → size KV → warm up.

`RankStartup` holds the steps and is the TP group's `StageGroup` (join, phase, agreement, failure).
The service runs them through the common boot (`services/thinker/__main__.py`); `start_rank` runs
them in-process, in the same order, for tests and benchmarks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable
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
from omnistage.common.runtime.stage_group import StageGroup
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs, graph_reserve_bytes
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.model_runner import ModelRunner, to_dtype
from omnistage.services.thinker.engine.prefill_graphs import PrefillGraphs, prefill_graph_reserve_bytes
from omnistage.services.thinker.group.decode_pace import DecodeStepTime, decode_step_times
from omnistage.services.thinker.group.faults import StartupFault
from omnistage.services.thinker.group.kv_profile import KVProfile, KVSettings, peers_bytes, size_kv_cache
from omnistage.services.thinker.group.warmup import (
    WarmupResult,
    minimal_warmup_shapes,
    run_warmup,
    warmup_shapes,
)
from omnistage.services.thinker.models.bailing_moe_v2 import BailingMoeV2ForCausalLM
from omnistage.services.thinker.models.layers.backends import (
    BackendError,
    Backends,
    install_backends,
    resolve_backends,
)
from omnistage.services.thinker.models.loader import load_model
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.services.thinker.tp.allreduce_choice import AllReduceChoice, choose_all_reduce
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
    # Every warm-up shape (False: `minimal_warmup_shapes`, a plain CPU's; the service's from
    # `StartupConfig.full_warmup`, in-process ranks full unless asked).
    full_warmup: bool = True
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
            device=svc.device_of(rank),
            rank=rank,
            world_size=svc.tp_size,
            host=cfg.host,
            dist_port=svc.dist_port,
            fault=svc.fault if svc.fault is not None and svc.fault.at else None,
            full_warmup=cfg.startup.full_warmup(svc.device_of(rank), svc.memory.simulated_capacity_bytes),
        )

    def for_rank(self, rank: int) -> RankConfig:
        """The same in-process deployment seen from `rank` (in-process groups run on the CPU; a GPU
        group's ranks start from the deploy file, `from_deploy`, each on its own GPU)."""
        if self.device != "cpu":
            raise ValueError(f"for_rank: in-process ranks run on the CPU, this config runs on {self.device}")
        return dataclasses.replace(self, rank=rank)

    @property
    def load_unit(self) -> str:
        """What loading counts: safetensors shards, or the layers of dummy weights."""
        return "shards" if self.load_format == "safetensors" else "layers"


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
        # The listener stays on the group after start-up: a failure while serving comes here too.
        log.error(
            "rank %d: the TP group failed (rank %d at fault): %s", self.rank, failure.rank, failure.message
        )


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
    decode_steps: list[DecodeStepTime] = field(default_factory=list)  # decode_pace.py's, for Describe
    all_reduce: str = ""  # the TP group's all-reduce path and why (AllReduceChoice.summary)

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
            "tp_allreduce": self.all_reduce,
        }


def start_rank(cfg: RankConfig, progress: StartupProgress | None = None) -> StartedRank:
    """Join the TP group and start this rank in-process (the service's ranks start through the common
    boot, in the same steps); raises StartupError naming the group's first failure."""
    progress = progress or LogProgress(cfg.rank)
    rank = RankStartup(cfg, progress)

    def enter(phase: str, unit: str) -> None:
        rank.enter(phase)
        progress.enter(phase, 0, unit)

    try:
        enter("loading_weights", cfg.load_unit)  # the rendezvous waits for the slowest rank's start
        rank.join()
        with rank.meter():
            rank.load()
            enter("profiling_memory", "attempts")
            rank.profile()
            if cfg.warmup:
                enter("warming_up", "shapes")
                rank.warm_up()
            if rank.graphs:
                enter("capturing_graphs", "graphs")
                rank.capture_graphs()
        rank.started()
    except Exception as exc:
        raise rank.failure(exc) from exc
    return rank.result()


def rank0_engine(started: StartedRank) -> LLMEngine:
    """Rank 0 after start-up: the step engine around its runner, tokenizer and TP group."""
    if started.tokenizer is None:
        raise ValueError(
            f"LLMEngine runs on rank 0 only (got rank {started.cfg.rank}); other ranks run the plan loop"
        )
    tok = started.tokenizer
    return LLMEngine(started.runner, tok, list(tok.stop_token_ids), started.control)


class RankStartup(StageGroup):
    """The steps of one rank's start-up, in order (state shared between them lives here), and the
    TP group's hooks of the common boot: join, phase, the last agreement, the group's failure."""

    def __init__(self, cfg: RankConfig, progress: StartupProgress, mem: DeviceMemory | None = None) -> None:
        self.cfg, self.progress = cfg, progress
        self.fault = StartupFault(cfg.fault, cfg.rank)
        self.control: TPControl | None = None
        self.phase = "start-up"
        self.runner: ModelRunner | None = None
        # The device's accountant: given (the boot's), or made for CUDA or a simulated device; None on a
        # plain CPU (the KV cache is then sized from the config).
        self.mem = mem if mem is not None else _device_memory(cfg)
        self.tokenizer: MingTokenizer | None = None
        self.graphs = False
        self.all_reduce: AllReduceChoice | None = None
        self.kv_profile: KVProfile | None = None
        self.warmup_result: WarmupResult | None = None
        self.decode_steps: list[DecodeStepTime] = []
        self.load_peak_bytes = 0
        self.peers_at_start = 0  # bytes others held on the device when loading began
        self.seconds: dict[str, float] = {}
        self._phase_started = time.monotonic()

    # --- the group's hooks (common/runtime/stage_group.py) -------------------------------------

    def join(self) -> None:
        """The rendezvous; from here on a failure of any rank ends every rank."""
        started = time.monotonic()
        cfg = self.cfg
        control = join_tp_group(cfg.rank, cfg.world_size, cfg.host, cfg.dist_port, cfg.device, cfg.tp)
        control.set_phase(self.phase)
        control.add_failure_listener(self.progress.failed)
        self.control = control
        self.seconds["rendezvous"] = time.monotonic() - started
        self._phase_started = time.monotonic()  # the phase's own time starts after the rendezvous

    def enter(self, phase: str) -> None:
        now = time.monotonic()
        if self.phase != "start-up":
            self.seconds[self.phase] = now - self._phase_started
        self.phase, self._phase_started = phase, now
        if self.control is not None:
            self.control.set_phase(phase)

    def started(self) -> None:
        """Start-up is over on this rank: collectives get the serving deadline from now on."""
        self.seconds[self.phase] = time.monotonic() - self._phase_started
        self._group().enter_serving()
        if self.all_reduce is not None and self.all_reduce.reducer is not None:
            self.all_reduce.reducer.set_timeout(self.cfg.tp.serving_collective_timeout_s)
        log.info(
            "start-up done: %s", json.dumps(self.result().summary())
        )  # one line per rank, for benchmarks

    def failure(self, exc: Exception) -> Exception:
        """The group's first failure (this rank's own, reported to the group first)."""
        if isinstance(exc, TPError):  # the group's failure already (or the rendezvous's: no group to tell)
            return exc if isinstance(exc, StartupError) else StartupError(exc.failure)
        if self.control is None:
            return exc
        culprit = getattr(exc, "culprit_rank", None)
        return StartupError(self.control.fail(self.control.where, exc, culprit=culprit))

    # --- the steps ------------------------------------------------------------------------------

    def meter(self) -> contextlib.AbstractContextManager[object]:
        """What the steps that make device tensors run inside (the simulated device counts them)."""
        return self.mem.meter() if self.mem is not None else contextlib.nullcontext()

    def step(self, detail: str, done: int = 0, total: int = 0) -> None:
        self.progress.step(detail, done, total)
        self.fault.on_step(self.phase, detail, self.runner, self.mem)

    def load(self) -> None:
        """loading_weights: the tokenizer (rank 0, before the weights: it fails fast), the weights,
        the kernels, and whether decode graphs will be captured."""
        cfg = self.cfg
        self.tokenizer = MingTokenizer(cfg.checkpoint) if cfg.rank == 0 else None
        self.fault.check_device(self.mem)
        self.peers_at_start = peers_bytes(self.mem) if self.mem is not None else 0
        self.choose_all_reduce()
        self.model: BailingMoeV2ForCausalLM = self.load_weights()
        backends = self.install_backends(self.model)
        self.graphs = self.graphs_wanted(backends)

    def choose_all_reduce(self) -> None:
        """The group's all-reduce path (a start-up collective on every rank); a peer path's blocks
        are freed and its device-side failures raised through the group (TPControl)."""
        cfg, control = self.cfg, self._group()
        device = torch.device(cfg.device)
        timeout_s = cfg.tp.startup_collective_timeout_s
        self.all_reduce = choose_all_reduce(control, cfg.engine.tp_allreduce, device, timeout_s)
        reducer = self.all_reduce.reducer
        if reducer is not None:
            control.on_close(reducer.close)
            control.add_check(reducer.check)

    def graphs_wanted(self, backends: Backends) -> bool:
        cfg = self.cfg
        graphs = cfg.engine.cuda_graphs and torch.device(cfg.device).type == "cuda" and backends.graph_safe
        self.tp_graphs = tp_graph_capture() if cfg.world_size > 1 else "off"  # read once, refused early
        if graphs and cfg.world_size > 1 and self.tp_graphs == "off":
            log.warning(
                "engine.cuda_graphs: %s=off: the TP group (tp %d) decodes eagerly",
                TP_GRAPHS_ENV,
                cfg.world_size,
            )
            return False
        return graphs

    def profile(self) -> None:
        """profiling_memory: size the KV cache (from the config on a plain CPU, else the auto-profile)."""
        cfg, model, mem = self.cfg, self.model, self.mem
        if mem is None:
            blocks = self._group().agree_min(
                resolve_engine_config(cfg.engine).num_kv_blocks, "agreeing on KV blocks"
            )
            self.runner = ModelRunner(model, resolve_engine_config(cfg.engine, blocks), cfg.device, cfg.rank)
            return
        one_request = -(-cfg.engine.max_model_len // cfg.engine.block_size)
        limits = resolve_engine_config(cfg.engine, one_request)  # as configured; no cache yet
        self.runner = ModelRunner(model, limits, cfg.device, cfg.rank, allocate=False)
        settings = KVSettings.from_config(cfg.engine, cfg.memory, mem.total())
        if self.graphs:  # the graphs' pool is kept free like the canary (and proven so)
            reserve = graph_reserve_bytes(self.graph_batch(), model.lm_head.rows, cfg.world_size)
            reserve += prefill_graph_reserve_bytes(
                self.prefill_graph_tokens(),
                cfg.engine.max_num_seqs,
                model.lm_head.rows,
                cfg.world_size,
                model.config.hidden_size,
                model.config.num_experts_per_tok,
            )
            settings = dataclasses.replace(settings, canary_bytes=settings.canary_bytes + reserve)
        self.kv_profile = size_kv_cache(
            self.runner, self._group(), mem, settings, peers_at_start=self.peers_at_start, progress=self.step
        )

    def warm_up(self) -> None:
        """warming_up: every dummy shape (a plain CPU's minimal ones) on every rank or on none."""
        prof, shapes = self.kv_profile, warmup_shapes if self.cfg.full_warmup else minimal_warmup_shapes
        self.warmup_result = run_warmup(
            self._runner(),
            self._group(),
            shapes(self._runner().cfg),
            mem=self.mem,
            cap_bytes=prof.cap_bytes if prof else 0,
            need_bytes=prof.shape_peaks if prof else None,
            progress=self.step,
        )
        self.decode_steps = decode_step_times(self._runner().cfg, self.warmup_result)

    def result(self) -> StartedRank:
        seconds = {k: round(v, 3) for k, v in self.seconds.items()}
        return StartedRank(
            self.cfg,
            self._runner(),
            self._group(),
            self.tokenizer,
            self.mem,
            self.kv_profile,
            self.warmup_result,
            seconds,
            self.load_peak_bytes,
            self.decode_steps,
            self.all_reduce.summary if self.all_reduce is not None else "",
        )

    def _group(self) -> TPControl:
        assert self.control is not None, "the rank has not joined its group"
        return self.control

    def _runner(self) -> ModelRunner:
        assert self.runner is not None, "the KV cache is not sized yet"
        return self.runner

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
            raise StartupError(self._group().fail("choosing kernels", exc)) from exc
        install_backends(model, backends)
        log.info("kernels: attention %s, moe %s", backends.attention, backends.moe)
        return backends

    def graph_batch(self) -> int:
        e = self.cfg.engine
        return min(e.cuda_graph_max_batch or e.max_num_seqs, e.max_num_seqs)

    def prefill_graph_tokens(self) -> tuple[int, ...]:
        """The prefill graphs' token counts a step can reach (none above max_num_batched_tokens)."""
        e = self.cfg.engine
        return tuple(sorted({n for n in e.prefill_graph_tokens if n <= e.max_num_batched_tokens}))

    def capture_graphs(self) -> None:
        """Every rank captures the same sizes (each replays what rank 0's plan says): the decode
        graphs, then the prefill graphs; a failure on any rank fails the group with its diagnostic,
        like a failed warm-up forward."""
        runner, control = self._runner(), self._group()
        graphs = DecodeGraphs(
            runner.model, self.graph_batch(), runner.cfg.max_blocks_per_seq, runner.device, feed=runner.feed
        )
        progress = lambda detail, done, total: self.step(detail, done, total)  # noqa: E731
        try:
            graphs.capture(progress=progress, align=self.aligner("decode graph batch"))
            if (
                self.tp_graphs == "aligned"
            ):  # a rank stuck in its last capture is named by the others' deadline
                control.agree_min(0, "captured every decode graph")
        except Exception as exc:
            raise StartupError(self._group().fail("capturing decode graphs", exc)) from exc
        runner.use_graphs(graphs)
        control.on_close(graphs.release)  # before the group is destroyed (see DecodeGraphs.release)
        sizes = self.prefill_graph_tokens()
        if not sizes:
            return
        from omnistage.services.thinker.kernels.paged_prefill import tile_tokens  # CUDA: triton is there

        layer = runner.model.attention_layers()[0]
        prefill = PrefillGraphs(
            runner.model,
            sizes,
            runner.cfg.max_num_seqs,
            runner.cfg.max_blocks_per_seq,
            tile_tokens(layer.num_heads, layer.num_kv_heads),
            runner.device,
        )
        try:
            prefill.capture(progress=progress, align=self.aligner("prefill graph (2 x tokens + 1 if media)"))
            if self.tp_graphs == "aligned":
                control.agree_min(0, "captured every prefill graph")
        except Exception as exc:
            raise StartupError(self._group().fail("capturing prefill graphs", exc)) from exc
        runner.use_prefill_graphs(prefill)
        control.on_close(prefill.release)

    def aligner(self, what: str) -> Callable[[int], None] | None:
        """With aligned TP capture: before each size, every rank agrees it captures that size (a rank
        with another size, or gone, fails the group)."""
        if self.tp_graphs != "aligned":
            return None

        def align(size: int) -> None:
            agreed = self._group().agree_min(size, f"capturing {what} {size}")
            if agreed != size:
                raise RuntimeError(
                    f"rank {self.cfg.rank} captures {what} {size} while a peer captures {agreed}"
                )

        return align

    def load_weights(self) -> BailingMoeV2ForCausalLM:
        cfg = self.cfg
        unit = cfg.load_unit

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
            small_all_reduce=self.all_reduce.reducer if self.all_reduce is not None else None,
        )
        if self.mem is not None:
            self.load_peak_bytes = self.mem.peak_allocated()
            self.mem.empty_cache()  # loading's temporaries must not count as the profile's peak
        return model


def _device_memory(cfg: RankConfig) -> DeviceMemory | None:
    if torch.device(cfg.device).type == "cuda" or cfg.memory.simulated_capacity_bytes:
        return device_memory_for(cfg.device, cfg.memory.simulated_capacity_bytes or None)
    return None
