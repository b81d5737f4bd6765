"""KV auto-profile and max-load stress of a Ling-mini-2.0-shaped thinker on a real GPU (self-checking).

    source bench/device_env.sh   # on a lent GPU machine
    python bench/ling_mini_gpu.py [--budget-fraction 0.9] [--peer-gib 8] [--tp 2 [--inject-oom-rank 1]]
    python bench/ling_mini_gpu.py --tiny          # CPU, tiny shape, simulated device (a smoke run)

Starts the thinker the service's way (`group/startup.py`) from a config-only checkpoint with
`load_format: dummy` (random bf16 weights made on the device, no fp32 copy), runs the auto-profile
against the device's real memory with a budget, warms up (rank-agreed), then a max-load stress (largest prefill chunk, largest decode batch at max
context with sampling, and real engine requests at near max context) that must stay inside the
budget. `--peer-gib X` starts a second process that holds X GiB of the same GPU before the profile
(a stage sharing it). `--tp N` spawns N ranks itself (no torchrun); `--inject-oom-rank R` makes rank R
raise an OOM inside a warm-up forward (the service's `fault.at: warmup_forward` hook), and the run
checks that every rank fails promptly naming it.
Prints phase times and one JSON summary line; exit status 0 only when every check passed.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import critical_path
import torch
from host_phases import host_phases, per_step_ms
from omnistage.common.bench_results import write_result
from triton_compiles import CompileWatch

GiB = 1 << 30
MiB = 1 << 20
SHAPES = ("ling-mini", "ming-flash", "ming-flash-tp2-rank")  # config_only.SHAPES


def _hold_peer_memory(gib: float, device: int, ready, release) -> None:
    """A second 'stage' on the same GPU: hold `gib` GiB until told to go."""
    buf = torch.empty(int(gib * GiB), dtype=torch.uint8, device=f"cuda:{device}")
    torch.cuda.synchronize()
    ready.set()
    release.wait(3600)
    del buf


def _engine_config(args):
    from omnistage.common.config import EngineConfig

    return EngineConfig(
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_canary_bytes=int(args.canary_mib * MiB),
        kv_safety_factor=args.safety_factor,
        kv_tokens=args.kv_tokens,
        async_scheduling=args.async_scheduling,
        tp_allreduce=args.tp_allreduce,
        **({} if args.prefill_graphs == "on" else {"prefill_graph_tokens": ()}),
    )


def run_rank(rank: int, args: argparse.Namespace, port: int, out_dir: str, ckpt: str) -> dict:
    """One rank: the service's start-up (dummy weights, profile, warm-up), a max-load stress, and
    (rank 0) real requests; returns its result dict."""
    from omnistage.common.config import FaultConfig, MemoryConfig, TPConfig
    from omnistage.common.log import setup_logging
    from omnistage.common.memory.device import SimulatedDeviceMemory, fmt_bytes
    from omnistage.services.thinker.engine.sampler import Sampler
    from omnistage.services.thinker.engine.sequence import SamplingParams
    from omnistage.services.thinker.group import startup
    from omnistage.services.thinker.group.startup import (
        LogProgress,
        RankConfig,
        StartupError,
        rank0_engine,
        start_rank,
    )
    from omnistage.services.thinker.group.warmup import run_dummy_step, stress_shapes
    from omnistage.services.thinker.group.worker import serve_plans

    setup_logging("thinker", rank=rank)
    if args.moe_tiles == "rule":  # a same-build comparison: the rule's tiles for every shape
        from omnistage.services.thinker.kernels import fused_moe

        fused_moe.TILES.clear()
    result_file = Path(out_dir) / f"rank{rank}.json"
    times: dict[str, float] = {}
    result: dict = {"rank": rank, "status": "error", "times": times}

    lock, saved = threading.Lock(), [False]  # main thread and peer watch may both fail: the first writes

    def save() -> None:
        with lock:
            if not saved[0]:
                tmp = result_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(result))
                tmp.rename(result_file)
                saved[0] = True

    stacks = _stack_file(args, rank)

    class Progress(LogProgress):
        def enter(self, phase: str, total: int = 0, unit: str = "") -> None:
            super().enter(phase, total, unit)
            if stacks is not None and phase == "capturing_graphs":  # every thread's stack if it sticks
                faulthandler.dump_traceback_later(args.stacks_after_s, file=stacks)

        def step(self, detail: str, done: int = 0, total: int = 0) -> None:
            print(f"[rank {rank}] {time.strftime('%H:%M:%S')} {detail}", flush=True)

        def failed(self, failure) -> None:  # the group's first failure, seen by any thread of this rank
            result.update(status="peer_failed" if failure.rank != rank else "error", message=failure.message)
            save()

    device = "cpu" if args.tiny else f"cuda:{rank}"
    if device != "cpu":
        torch.cuda.set_device(device)
    simulated = int(args.sim_capacity_gib * GiB) if args.tiny else 0
    if args.tiny and args.peer_gib:
        mem = SimulatedDeviceMemory(simulated, name="cpu-sim")
        mem.reserve(int(args.peer_gib * GiB), "peer stage")
        startup.device_memory_for = lambda device, simulated=None: mem
    fault = None
    if args.inject_oom_rank is not None:
        fault = FaultConfig(phase="warming_up", action="oom", rank=args.inject_oom_rank, at="warmup_forward")
    cfg = RankConfig(
        ckpt,
        _engine_config(args),
        MemoryConfig(budget_fraction=args.budget_fraction, simulated_capacity_bytes=simulated),
        TPConfig(startup_collective_timeout_s=args.timeout_s),
        load_format="dummy",
        dtype=args.dtype,
        device=device,
        rank=rank,
        world_size=args.tp,
        dist_port=port,
        fault=fault,
    )
    compiles = CompileWatch() if device != "cpu" and rank == 0 else None
    try:
        started = start_rank(cfg, Progress(rank))
        faulthandler.cancel_dump_traceback_later()
        if compiles is not None:
            result["compiles"] = {"start-up": compiles.mark("start-up (profile, capture, warm-up)")}
    except StartupError as exc:
        result.update(status="error", message=str(exc), traceback=traceback.format_exc())
        save()
        return result
    try:
        runner, control, mem, prof = started.runner, started.control, started.mem, started.kv_profile
        times.update({f"{k}_s": v for k, v in started.phase_seconds.items()})
        weights = runner.weights_bytes()
        result.update(weights_bytes=weights, load_peak_bytes=started.load_peak_bytes)
        print(
            f"[rank {rank}] weights {fmt_bytes(weights)}, peak while loading {fmt_bytes(started.load_peak_bytes)}",
            flush=True,
        )
        result.update(
            kv_blocks=prof.num_blocks,
            kv_tokens=prof.num_blocks * runner.cfg.block_size,
            kv_bytes=prof.kv_bytes,
            cap_bytes=prof.cap_bytes,
            peers_bytes=prof.peers_bytes,
            activation_peak_bytes=prof.activation_peak_bytes,
            peak_reserved_bytes=prof.peak_reserved_bytes,
            headroom_bytes=prof.headroom_bytes,
            attempts=prof.attempts,
            profile_phases=prof.phase_seconds,
            summary=prof.summary(),
            warmup_ran=started.warmup.ran,
            warmup_skipped=started.warmup.skipped,
        )

        # Max-load stress at the chosen size: must not OOM and must stay inside the budget.
        t0 = time.monotonic()
        with mem.meter():
            mem.reset_peak()
            sampler = Sampler()
            for shape in stress_shapes(runner.cfg):
                run_dummy_step(runner, shape, sampler)
            if device != "cpu":
                torch.cuda.synchronize(device)
            times["max_load_stress_s"] = time.monotonic() - t0
            if compiles is not None:
                result["compiles"]["max-load stress"] = compiles.mark("max-load stress")
            result["stress_peak_reserved_bytes"] = mem.peak_reserved()

            # Real requests through the engine near max context (distinct KV blocks, chunked prefill).
            t0 = time.monotonic()
            n_req = min(args.real_requests, runner.cfg.max_num_seqs)
            if rank == 0:
                engine = rank0_engine(started)
                prompt_len = runner.cfg.max_model_len - args.real_max_tokens
                gen = torch.Generator().manual_seed(1)
                prompts = [
                    torch.randint(2, 1000, (prompt_len,), generator=gen).tolist() for _ in range(n_req)
                ]
                params = SamplingParams(
                    temperature=0.8, top_k=50, top_p=0.9, max_tokens=args.real_max_tokens, ignore_eos=True
                )
                outs = engine.generate(prompts, params, timeout_s=args.timeout_s * 5)
                result["real_tokens"] = sum(len(o.token_ids) for o in outs)
                result["async_scheduling"] = engine.async_scheduling
                if compiles is not None:
                    result["compiles"]["real requests"] = compiles.mark("real requests near max context")
                if args.sweep:
                    result["sweep"] = decode_sweep(engine, args, device, compiles)
                if args.prefill_profile:
                    result["prefill_profile"] = [
                        profile_prefill(engine, n, length) for n, length in args.prefill_profile
                    ]
                if args.profile_c:
                    result["profile"] = {
                        f"c{c}-{'graphs' if graphs else 'eager'}": profile_steps(engine, c, graphs)
                        for c in args.profile_c
                        for graphs in (True, False)
                    }
                engine.shutdown()
            else:
                serve_plans(control, runner)
                control.close()
            times["real_requests_s"] = time.monotonic() - t0
            result["final_peak_reserved_bytes"] = mem.peak_reserved()
        result["status"] = "ok"
    except Exception as exc:
        failure = started.control.fail("ling-mini bench", exc)
        result.update(status="error", message=failure.message, traceback=traceback.format_exc())
    save()
    return result


def _device_rows(prof, per: int) -> tuple[list[dict], float]:
    """The profiler's device time by kernel (ms, divided by `per`), largest first, and its total."""
    rows, device_ms = [], 0.0
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) or 0
        if dev_us > 0:
            device_ms += dev_us / per / 1e3
            rows.append({"kernel": ev.key[:90], "calls": ev.count // per, "ms": round(dev_us / per / 1e3, 4)})
    rows.sort(key=lambda r: -r["ms"])
    return rows, device_ms


def profile_prefill(engine, n: int, length: int, repeats: int = 3) -> dict:
    """n fresh prompts of `length` tokens added at once (random ids: no cached prefix), each asking one
    token: rank 0's wall from the add to every first token (the engine's TTFT of such an arrival) and
    the device time by kernel of the last of `repeats` rounds (the first warms the shapes)."""
    from omnistage.services.thinker.engine.sequence import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(17 + n * length)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    walls, prof = [], None
    for r in range(repeats):
        for i in range(n):
            engine.add_prompt(
                f"prefill-{n}x{length}-{r}-{i}",
                torch.randint(2, 150_000, (length,), generator=gen).tolist(),
                SamplingParams(max_tokens=1, ignore_eos=True),
            )
        sync()
        if r == repeats - 1:
            prof = profile(activities=activities)
            prof.__enter__()
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        sync()
        walls.append(time.perf_counter() - t0)
        if prof is not None:
            prof.__exit__(None, None, None)
    rows, device_ms = _device_rows(prof, 1)
    wall_ms = 1e3 * min(walls[1:] or walls)
    print(
        f"[prefill] {n} x {length} tokens: {wall_ms:.2f} ms to every first token (rounds "
        f"{', '.join(f'{1e3 * w:.1f}' for w in walls)} ms, {steps} engine steps), {device_ms:.2f} ms of kernels",
        flush=True,
    )
    for row in rows[:16]:
        print(f"  {row['ms']:8.3f} ms  x{row['calls']:<4d} {row['kernel']}", flush=True)
    host = sorted(
        (
            {"op": ev.key[:90], "calls": ev.count, "cpu_ms": round(ev.self_cpu_time_total / 1e3, 3)}
            for ev in prof.key_averages()
            if ev.self_cpu_time_total > 0
        ),
        key=lambda r: -r["cpu_ms"],
    )
    print(f"[prefill] {n} x {length}: host time by op (self CPU)", flush=True)
    for row in host[:10]:
        print(f"  {row['cpu_ms']:8.3f} ms  x{row['calls']:<4d} {row['op']}", flush=True)
    return {
        "host_top": host[:15],
        "prompts": n,
        "prompt_tokens": length,
        "wall_ms": round(wall_ms, 3),
        "rounds_ms": [round(1e3 * w, 3) for w in walls],
        "engine_steps": steps,
        "device_ms": round(device_ms, 3),
        "top": rows[:30],
    }


def profile_steps(engine, c: int, graphs: bool, steps: int = 8) -> dict:
    """Rank 0's view of `steps` decode steps at concurrency c (graph replays or eager: the workers
    follow the plans either way, their collectives in the same order): wall per step, device time by
    kernel, and the host time the step spends outside the device."""
    from omnistage.services.thinker.engine.sequence import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(13)
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    saved = engine.runner.graphs
    engine.runner.graphs = saved if graphs else None
    try:
        for i in range(c):
            engine.add_prompt(
                f"prof-{graphs}-{c}-{i}",
                torch.randint(2, 1000, (128,), generator=gen).tolist(),
                SamplingParams(max_tokens=steps + 8, ignore_eos=True),
            )
        for _ in range(3):
            engine.step()
        sync()
        with profile(activities=activities) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            sync()
            wall = (time.perf_counter() - t0) / steps
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.graphs = saved
    rows, device_ms = [], 0.0
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0) or 0
        if dev_us > 0:
            device_ms += dev_us / steps / 1e3
            rows.append(
                {
                    "kernel": ev.key[:90],
                    "calls": ev.count // steps,
                    "ms_per_step": round(dev_us / steps / 1e3, 4),
                }
            )
    rows.sort(key=lambda r: -r["ms_per_step"])
    host = sorted(
        (
            {
                "op": ev.key[:90],
                "calls": ev.count // steps,
                "cpu_ms_per_step": round(ev.self_cpu_time_total / steps / 1e3, 4),
            }
            for ev in prof.key_averages()
            if ev.self_cpu_time_total > 0
        ),
        key=lambda r: -r["cpu_ms_per_step"],
    )
    mode = "graphs" if graphs else "eager"
    critical = critical_path.summary(prof, steps) if cuda else None
    launches = sum(r["calls"] for r in rows)  # device ops per step (kernels, copies, fills): graph nodes
    print(
        f"[profile] c={c} {mode}: {1e3 * wall:.2f} ms per step wall, {device_ms:.2f} ms of kernels, "
        f"{launches} device ops per step",
        flush=True,
    )
    for r in rows[:18]:
        print(f"  {r['ms_per_step']:8.3f} ms  x{r['calls']:<4d} {r['kernel']}", flush=True)
    print(f"[profile] c={c} {mode}: host time by op (self CPU)", flush=True)
    for r in host[:10]:
        print(f"  {r['cpu_ms_per_step']:8.3f} ms  x{r['calls']:<4d} {r['op']}", flush=True)
    if critical:
        critical_path.print_summary(f"c={c} {mode}", critical)
    return {
        "critical_path": critical,
        "mode": mode,
        "wall_ms": round(1e3 * wall, 3),
        "device_ms": round(device_ms, 3),
        "device_ops": launches,
        "top": rows[:30],
        "host_top": host[:15],
    }


def _stack_file(args: argparse.Namespace, rank: int):
    """--stacks-dir: this rank's file for faulthandler (SIGUSR1 from the parent, or a capture that sticks)."""
    if not args.stacks_dir:
        return None
    Path(args.stacks_dir).mkdir(parents=True, exist_ok=True)
    f = open(Path(args.stacks_dir) / f"rank{rank}.txt", "w")  # noqa: SIM115 - lives as long as the rank
    faulthandler.register(signal.SIGUSR1, file=f, all_threads=True)
    return f


def decode_sweep(engine, args: argparse.Namespace, device: str, compiles=None) -> list[dict]:
    """Requests/s and output tokens/s at each concurrency (greedy, ignore EOS, fixed output length);
    with a CompileWatch, the kernels each level compiled (a first-use cost the warm-up missed)."""
    from omnistage.services.thinker.engine.sequence import SamplingParams

    gen = torch.Generator().manual_seed(2)
    rows = []
    levels = [int(x) for x in args.sweep.split(",")]
    cap = engine.runner.cfg.max_num_seqs
    if max(levels) > cap:  # more requests than sequences run in turns: the level's rate would not be its own
        raise SystemExit(f"--sweep {args.sweep}: a level above max_num_seqs {cap} (--max-num-seqs)")
    for c in levels:
        prompts = [torch.randint(2, 1000, (args.sweep_prompt_len,), generator=gen).tolist() for _ in range(c)]
        params = SamplingParams(max_tokens=args.sweep_tokens, ignore_eos=True)
        if device != "cpu":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        with host_phases(engine) as phases:
            outs = engine.generate(prompts, params, timeout_s=args.timeout_s * 20)
        if device != "cpu":
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t0
        host_ms = per_step_ms(phases)
        toks = sum(len(o.token_ids) for o in outs)
        ttft_s = max(o.usage.time_to_first_token_ms for o in outs if o.usage) / 1000 if outs else 0.0
        decode_tok_s = (toks - len(outs)) / (dt - ttft_s) if dt > ttft_s else 0.0
        rows.append(
            {
                "concurrency": c,
                "seconds": dt,
                "req_s": c / dt,
                "out_tok_s": toks / dt,
                # after every first token (the prompts' prefill and first step out): the decode rate the
                # HBM floor bounds, as issue 40's "decodes at 170 tok/s (159.5 with its first token)"
                "decode_tok_s": decode_tok_s,
                "ttft_ms": ttft_s * 1000,
                "first_tokens": list(outs[0].token_ids[:32]),
                "compiled": compiles.mark(f"sweep c={c}") if compiles is not None else [],
                "host_ms_per_step": host_ms,
                "steps": int(phases["steps"]),
            }
        )  # greedy: equal across kernel/graph modes
        print(
            f"[sweep] c={c} {dt:.2f}s {c / dt:.3f} req/s {toks / dt:.1f} out tok/s"
            f" ({decode_tok_s:.1f} decoding after the first tokens at {ttft_s * 1000:.1f} ms)",
            flush=True,
        )
        print(f"[host] c={c} ms a step ({int(phases['steps'])} steps): {host_ms}", flush=True)
    return rows


def _rank_main(rank: int, args: argparse.Namespace, port: int, out_dir: str, ckpt: str) -> None:
    res = run_rank(rank, args, port, out_dir, ckpt)
    # The result is on disk; leave without interpreter teardown, which can block on a NCCL
    # communicator whose peer died mid-collective (not what this bench measures).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if res["status"] == "ok" else 1)


def check(results: list[dict], args: argparse.Namespace, elapsed: float) -> list[str]:
    """Every failed check, as a sentence; empty when the run is what it should be."""
    problems = []
    if args.inject_oom_rank is not None:
        bad = args.inject_oom_rank
        for r in results:
            msg = r.get("message", "")
            if r.get("status") == "ok":
                problems.append(f"rank {r['rank']} finished although rank {bad} failed in warm-up")
            elif f"rank {bad} failed in warm-up shape" not in msg:
                problems.append(f"rank {r['rank']} did not name rank {bad} and the shape: {msg[:300]!r}")
        if elapsed > args.inject_deadline_s:
            problems.append(f"ranks took {elapsed:.0f}s to fail (deadline {args.inject_deadline_s:.0f}s)")
        return problems
    for r in results:
        rank = r.get("rank")
        if r.get("status") != "ok":
            problems.append(f"rank {rank} failed: {r.get('message', 'no result')}")
            continue
        cap = r["cap_bytes"]
        for key in ("stress_peak_reserved_bytes", "final_peak_reserved_bytes"):
            if r[key] > cap:
                problems.append(f"rank {rank}: {key} {r[key]} exceeds the budget {cap}")
        if r["load_peak_bytes"] > r["weights_bytes"] * 1.05 + 64 * MiB:
            problems.append(f"rank {rank}: peak while building {r['load_peak_bytes']} > weights x 1.05")
        if r.get("warmup_skipped"):
            problems.append(f"rank {rank}: warm-up skipped {r['warmup_skipped']}")
    blocks = {r.get("kv_blocks") for r in results if r.get("status") == "ok"}
    if len(blocks) > 1:
        problems.append(f"ranks chose different KV sizes: {sorted(blocks)}")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shape, simulated device")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--shape", choices=SHAPES, default="ling-mini", help="model shape (GPU runs)")
    ap.add_argument("--sweep", default="", help="decode sweep concurrencies after the checks, e.g. 1,2,4,8")
    ap.add_argument("--sweep-tokens", type=int, default=150)
    ap.add_argument("--sweep-prompt-len", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--budget-fraction", type=float, default=0.9, help="of the GPU (or simulated device)")
    ap.add_argument("--peer-gib", type=float, default=0.0, help="another stage holds this much first")
    ap.add_argument("--inject-oom-rank", type=int, default=None)
    ap.add_argument("--inject-deadline-s", type=float, default=90.0)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="64 (tiny: 8)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, help="4096 (tiny: 128)")
    ap.add_argument("--max-model-len", type=int, default=None, help="8192 (tiny: 512)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument(
        "--async-scheduling",
        choices=("auto", "on", "off"),
        default="auto",
        help="engine.async_scheduling: plan the next step while the device runs this one (auto: on CUDA)",
    )
    ap.add_argument(
        "--tp-allreduce",
        choices=("auto", "nccl"),
        default="auto",
        help="engine.tp_allreduce (its default auto): a decode step's small messages summed over CUDA IPC "
        "peer memory, NCCL the rest; nccl: NCCL for all",
    )
    ap.add_argument("--canary-mib", type=float, default=None, help="256 (tiny: 4)")
    ap.add_argument("--safety-factor", type=float, default=1.0)
    ap.add_argument("--kv-tokens", type=int, default=0, help="pin the KV size (skips the search)")
    ap.add_argument("--real-requests", type=int, default=None, help="8 (tiny: 2)")
    ap.add_argument("--real-max-tokens", type=int, default=4)
    ap.add_argument("--sim-capacity-gib", type=float, default=0.5, help="--tiny: simulated device size")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="collective deadline")
    ap.add_argument("--out", default="", help="write the JSON summary here too")
    ap.add_argument(
        "--tp-graphs",
        choices=("off", "aligned", "unaligned"),
        default=None,
        help="decode graphs under TP (sets OMNISTAGE_TP_CUDA_GRAPHS for the ranks)",
    )
    ap.add_argument("--stacks-dir", default="", help="each rank's thread stacks land here if it sticks")
    ap.add_argument(
        "--stacks-after-s", type=float, default=60.0, help="a capture phase this long dumps stacks"
    )
    ap.add_argument(
        "--profile-c",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="rank 0 profiles decode steps at these concurrencies, graphs and eager (e.g. 1,32)",
    )
    ap.add_argument(
        "--prefill-profile",
        type=lambda v: [tuple(int(x) for x in case.split("x")) for case in v.split(",") if case],
        default=[],
        help="rank 0 times and profiles prompts arriving together, NxL each (e.g. 1x64,8x64,32x64)",
    )
    ap.add_argument(
        "--prefill-graphs",
        choices=("on", "off"),
        default="on",
        help="off: engine.prefill_graph_tokens () (small prefill steps run eagerly; a same-build comparison)",
    )
    ap.add_argument(
        "--moe-tiles",
        choices=("measured", "rule"),
        default="measured",
        help="rule: fused_moe's rule tiles for every shape (fused_moe.TILES cleared in the ranks)",
    )
    ap.add_argument(
        "--wall-s", type=float, default=0.0, help="TP: stop the ranks after this long (0: no limit)"
    )
    ap.add_argument(
        "--fusions",
        choices=("on", "off"),
        default=None,
        help="the decode step's fused MoE glue (sets OMNISTAGE_THINKER_FUSIONS for the ranks)",
    )
    ap.add_argument(
        "--gemv",
        choices=("on", "off"),
        default=None,
        help="the projections' Triton GEMV at small batch (sets OMNISTAGE_THINKER_GEMV for the ranks)",
    )
    ap.add_argument(
        "--resident",
        choices=("on", "off"),
        default=None,
        help="the weights-first projections of one or two tokens (sets OMNISTAGE_THINKER_RESIDENT for the ranks)",
    )
    ap.add_argument(
        "--qkv-rope",
        choices=("on", "off"),
        default=None,
        help="QK-norm + rope in the qkv projection's launch at one or two tokens (sets OMNISTAGE_THINKER_QKV_ROPE for the ranks)",
    )
    ap.add_argument(
        "--gateup-select",
        choices=("on", "off"),
        default=None,
        help="one token's experts selected in the gate-up launch (sets OMNISTAGE_THINKER_GATEUP_SELECT for the ranks)",
    )
    ap.add_argument(
        "--fused-embed",
        choices=("on", "off"),
        default=None,
        help="the step's embedding lookup in one launch (sets OMNISTAGE_THINKER_FUSED_EMBED for the ranks)",
    )
    ap.add_argument(
        "--pdl",
        choices=("on", "off"),
        default=None,
        help="programmatic dependent launch of the Triton kernels (sets OMNISTAGE_THINKER_PDL for the ranks)",
    )
    args = ap.parse_args(argv)
    if args.pdl is not None:
        os.environ["OMNISTAGE_THINKER_PDL"] = args.pdl
    if args.tp_graphs is not None:  # the spawned ranks inherit it
        os.environ["OMNISTAGE_TP_CUDA_GRAPHS"] = args.tp_graphs
    if args.fusions is not None:
        os.environ["OMNISTAGE_THINKER_FUSIONS"] = args.fusions
    if args.gemv is not None:
        os.environ["OMNISTAGE_THINKER_GEMV"] = args.gemv
    if args.resident is not None:
        os.environ["OMNISTAGE_THINKER_RESIDENT"] = args.resident
    if args.qkv_rope is not None:
        os.environ["OMNISTAGE_THINKER_QKV_ROPE"] = args.qkv_rope
    if args.gateup_select is not None:
        os.environ["OMNISTAGE_THINKER_GATEUP_SELECT"] = args.gateup_select
    if args.fused_embed is not None:
        os.environ["OMNISTAGE_THINKER_FUSED_EMBED"] = args.fused_embed
    defaults = dict(
        max_num_seqs=(64, 8),
        max_num_batched_tokens=(4096, 128),
        max_model_len=(8192, 512),
        canary_mib=(256, 4),
        real_requests=(8, 2),
    )
    for key, (gpu, tiny) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, tiny if args.tiny else gpu)
    if not args.tiny and not torch.cuda.is_available():
        print("no CUDA device: use --tiny on CPU", file=sys.stderr)
        return 2
    # The repository root, for tests/…/local_ranks.py.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.services.thinker.group.local_ranks import free_port

    peer = None
    if args.peer_gib and not args.tiny:
        ctx = mp.get_context("spawn")
        ready, release = ctx.Event(), ctx.Event()
        peer = (
            ctx.Process(target=_hold_peer_memory, args=(args.peer_gib, 0, ready, release), daemon=True),
            release,
        )
        peer[0].start()
        if not ready.wait(120):
            print("the peer process did not allocate its memory within 120s", file=sys.stderr)
            return 2
        print(f"peer stage holds {args.peer_gib} GiB of cuda:0", flush=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="ling-mini-") as out_dir:
        from omnistage.common.checkpoint.config_only import write_config_checkpoint

        ckpt = str(write_config_checkpoint(Path(out_dir) / "ckpt", "tiny" if args.tiny else args.shape))
        port = free_port()
        if args.tp == 1:
            results = [run_rank(0, args, port, out_dir, ckpt)]
        else:
            ctx = mp.get_context("spawn")
            procs = [
                ctx.Process(target=_rank_main, args=(r, args, port, out_dir, ckpt), name=f"rank{r}")
                for r in range(args.tp)
            ]
            for p in procs:
                p.start()
            limit = args.inject_deadline_s if args.inject_oom_rank is not None else args.timeout_s * 10
            limit = min(limit, args.wall_s) if args.wall_s else limit
            files = [Path(out_dir) / f"rank{r}.json" for r in range(args.tp)]
            while time.monotonic() < started + limit:  # until every rank has a result or is gone
                if all(f.exists() or not p.is_alive() for f, p in zip(files, procs, strict=True)):
                    break
                time.sleep(0.2)
            elapsed = time.monotonic() - started
            grace = 5 if args.wall_s else 30
            for p in procs:
                p.join(max(1.0, started + limit + grace - time.monotonic()))
                if p.is_alive() and args.stacks_dir:
                    os.kill(p.pid, signal.SIGUSR1)  # its stacks into --stacks-dir before it goes
                    time.sleep(2)
                if p.is_alive():
                    print(
                        f"{p.name} still running {limit + 30:.0f}s after start: killing it", file=sys.stderr
                    )
                    p.kill()
                    p.join(10)
            results = []
            for r, p in enumerate(procs):
                f = Path(out_dir) / f"rank{r}.json"
                res = json.loads(f.read_text()) if f.exists() else {"rank": r, "status": "no_result"}
                res["exitcode"] = p.exitcode
                results.append(res)
    if args.tp == 1:
        elapsed = time.monotonic() - started
    if peer is not None:
        peer[1].set()
        peer[0].join(30)
    problems = check(results, args, elapsed)
    for r in results:
        r.pop("traceback", None) if r.get("status") == "ok" else None
        print(json.dumps(r, indent=1, default=str)[:4000], flush=True)
    summary = {
        "device": "cpu (simulated)" if args.tiny else torch.cuda.get_device_name(0),
        "tp": args.tp,
        "fusions": os.environ.get("OMNISTAGE_THINKER_FUSIONS", "on"),
        "gemv": os.environ.get("OMNISTAGE_THINKER_GEMV", "off"),  # backends.gemv_enabled()'s default
        "pdl": os.environ.get("OMNISTAGE_THINKER_PDL", "on"),  # kernels/pdl.py's default
        "resident": os.environ.get("OMNISTAGE_THINKER_RESIDENT", "on"),  # backends.resident_enabled()'s
        "qkv_rope": os.environ.get("OMNISTAGE_THINKER_QKV_ROPE", "on"),  # backends.qkv_rope_enabled()'s
        "gateup_select": os.environ.get(
            "OMNISTAGE_THINKER_GATEUP_SELECT", "off"
        ),  # gateup_select_enabled()'s
        "fused_embed": os.environ.get("OMNISTAGE_THINKER_FUSED_EMBED", "on"),  # fused_embed_enabled()'s
        "dense_gateup": os.environ.get(
            "OMNISTAGE_THINKER_DENSE_GATEUP", "on"
        ),  # backends.dense_gateup_enabled()'s
        "tp_allreduce": args.tp_allreduce,
        "elapsed_s": round(elapsed, 1),
        "ok": not problems,
        "problems": problems,
        "kv_tokens": [r.get("kv_tokens") for r in results],
        "headroom_gib": [
            round(r["headroom_bytes"] / GiB, 3) if "headroom_bytes" in r else None for r in results
        ],
    }
    line = json.dumps(summary)
    print("SUMMARY " + line, flush=True)
    if args.out:
        write_result(
            args.out, {"device": summary["device"], "summary": summary, "ranks": results}, gpu=not args.tiny
        )
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
