"""Thinker decode speed on one GPU against transformers and the memory floor, all in one run.

    source bench/device_env.sh     # on a lent GPU machine (carry .cache/gpu-whl)
    python bench/thinker_decode.py --out $OUT/thinker_decode.json [--concurrency 1,8,32,64]

1. Ceiling: device-to-device copy bandwidth (read + write bytes), measured here.
2. Correctness on the tiny checkpoint: fp32 greedy tokens of every kernel combination (torch eager,
   triton eager, triton + CUDA graphs) equal the CPU fp32 engine for 64 steps; bf16 logits of the
   triton kernels within bf16 tolerance of the torch kernels.
3. Ling-mini shape (random bf16, `load_format: dummy`): 128-token prompts, 128 new greedy tokens at each
   concurrency; decode step = (t(128 new) - t(1 new)) / 127, tok/s = c * 1000 / step_ms; the
   reference kernels (torch, no graphs) at c <= 8 for the before/after.
4. transformers `generate()` on the same shape (Glm4MoeForCausalLM, experts through grouped_mm).
5. Floor per step: non-expert weights (embedding table excluded) + the distinct experts a step's c
   tokens hit (uniform routing, as random weights give) + the KV read, over the measured bandwidth.
6. A profile of one eager decode step (kernel time by name) and the host time of one graph step.
Prints a table last; `--out` writes {"device", "date", "command", "rows": [...]} plus the details.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result

GiB = 1 << 30


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 4 GiB device-to-device copy (read + write), median of 10."""
    src = torch.empty(4 * GiB, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * 4 * GiB / sorted(times[3:])[len(times[3:]) // 2]


def start(
    ckpt: str,
    dtype: str,
    device: str,
    attention: str,
    moe: str,
    graphs: bool,
    max_seqs: int,
    max_len: int,
    kv_tokens: int,
):
    from omnistage.common.config import EngineConfig, MemoryConfig
    from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank

    engine_cfg = EngineConfig(
        block_size=16,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_seqs * 2),
        max_model_len=max_len,
        kv_tokens=kv_tokens,
        attention_backend=attention,
        moe_backend=moe,
        cuda_graphs=graphs,
    )
    memory = MemoryConfig(budget_fraction=0.9) if device != "cpu" else MemoryConfig()
    load = "dummy" if dtype == "bfloat16" else "safetensors"
    return rank0_engine(
        start_rank(RankConfig(ckpt, engine_cfg, memory, load_format=load, dtype=dtype, device=device))
    )


def correctness(device: str, steps: int) -> dict:
    """Greedy tokens of every kernel combination vs the CPU fp32 engine (tiny checkpoint)."""
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint
    from omnistage.services.thinker.engine.sequence import SamplingParams

    out: dict = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(write_tiny_checkpoint(d, seed=0))
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 900, (n,), generator=gen).tolist() for n in (5, 37, 64, 100)]
        params = SamplingParams(max_tokens=steps, ignore_eos=True)
        ref = start(ckpt, "float32", "cpu", "torch", "torch", False, 8, 512, 0)
        want = [r.token_ids for r in ref.generate(prompts, params)]
        release(ref)
        combos = [
            ("torch", "torch", False),
            ("triton", "triton", False),
            ("triton", "triton", True),
            ("torch", "triton", False),
            ("triton", "torch", False),
        ]
        for attention, moe, graphs in combos:
            name = f"{attention}/{moe}/{'graphs' if graphs else 'eager'}"
            try:
                e = start(ckpt, "float32", device, attention, moe, graphs, 8, 512, 8192)
                got = [r.token_ids for r in e.generate(prompts, params)]
                same = sum(a == b for x, y in zip(got, want, strict=True) for a, b in zip(x, y, strict=True))
                replays = e.runner.graphs.replays if e.runner.graphs is not None else 0
                out[name] = {
                    "identical": got == want,
                    "tokens_equal": same,
                    "tokens": steps * len(prompts),
                    "graph_replays": replays,
                }
                release(e)
            except Exception as exc:
                out[name] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc()[-1500:],
                }
            print(f"[correctness] fp32 {name}: {out[name]}", flush=True)
        out["bf16_logits"] = bf16_logits(ckpt, device)
        print(f"[correctness] bf16 logits triton vs torch: {out['bf16_logits']}", flush=True)
    return out


def bf16_logits(ckpt: str, device: str) -> dict:
    """Relative error of one prefill + decode step's logits, triton kernels vs torch, in bf16."""
    from omnistage.services.thinker.engine.step_plan import build_step_plan
    from omnistage.services.thinker.models.layers.backends import Backends, install_backends

    e = start(ckpt, "bfloat16", device, "torch", "torch", False, 8, 512, 4096)
    runner = e.runner
    gen = torch.Generator().manual_seed(5)
    from omnistage.services.thinker.engine.sequence import SamplingParams, Sequence

    seqs = [
        Sequence(f"s{i}", torch.randint(0, 900, (n,), generator=gen).tolist(), SamplingParams(), 8)
        for i, n in enumerate((7, 50, 90))
    ]
    bm = e.scheduler.block_manager
    for s in seqs:
        bm.allocate(s, s.num_prompt_tokens)
    plan = build_step_plan([(s, s.num_prompt_tokens) for s in seqs], runner.cfg.block_size)
    errs = {}
    results = {}
    for name in ("torch", "triton"):
        install_backends(runner.model, Backends(name, name))
        results[name] = runner.execute_step(plan).logits.to(torch.float32, copy=True)
    ref = results["torch"]
    errs["prefill_rel_err"] = float((results["triton"] - ref).norm() / ref.norm())
    for s in seqs:
        s.num_computed_tokens = s.num_prompt_tokens
        s.token_ids.append(1)
        bm.allocate(s, 1)
    plan = build_step_plan([(s, 1) for s in seqs], runner.cfg.block_size)
    for name in ("torch", "triton"):
        install_backends(runner.model, Backends(name, name))
        results[name] = runner.execute_step(plan).logits.to(torch.float32, copy=True)
    ref = results["torch"]
    errs["decode_rel_err"] = float((results["triton"] - ref).norm() / ref.norm())
    release(e)
    return errs


def release(engine) -> None:
    """Shut an engine down and give its device memory back before the next one starts (the
    engine's objects form cycles: without a collection its KV cache would outlive it)."""
    engine.shutdown()
    engine.runner.free_kv()
    engine.runner.model = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def timed_generate(engine, prompts, max_tokens: int) -> float:
    from omnistage.services.thinker.engine.sequence import SamplingParams

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True), timeout_s=1800)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def sweep_ours(engine, concurrency: list[int], prompt_len: int, new: int, vocab: int) -> dict[int, dict]:
    """Per concurrency: the median wall time of a pure decode step (engine.step(), host work and the
    sampled-id copy included) and the end-to-end tokens/s of c requests of `new` tokens."""
    gen = torch.Generator().manual_seed(7)
    rows = {}
    for c in concurrency:
        prompts = [torch.randint(2, vocab - 1, (prompt_len,), generator=gen).tolist() for _ in range(c)]
        timed_generate(engine, prompts, 4)  # every shape of this run compiled before timing
        step = decode_step_ms(engine, prompts, new)
        tn = timed_generate(engine, prompts, new)
        rows[c] = {
            "step_ms": step["median_ms"],
            "tok_s": c * 1e3 / step["median_ms"],
            "e2e_tok_s": c * new / tn,
            "e2e_s": tn,
            **{k: v for k, v in step.items() if k != "median_ms"},
        }
        print(
            f"[ours] c={c} decode step {step['median_ms']:.2f} ms (runner+sync {step['runner_ms']:.2f} ms, "
            f"{step['graph_replays']} replays / {step['steps']}), {c * 1e3 / step['median_ms']:.1f} tok/s; "
            f"e2e {c * new / tn:.1f} tok/s",
            flush=True,
        )
    return rows


def decode_step_ms(engine, prompts: list[list[int]], new: int) -> dict:
    """Add the requests, step through their prefill, then time pure decode steps one by one (and the
    share of each spent in the runner, synchronised)."""
    from omnistage.services.thinker.engine.sequence import SamplingParams

    runner = engine.runner
    inner = runner.execute_step
    spent: list[float] = []

    def timed(plan):
        t0 = time.perf_counter()
        out = inner(plan)
        torch.cuda.synchronize()
        spent.append((time.perf_counter() - t0) * 1e3)
        return out

    for i, p in enumerate(prompts):
        engine.add_prompt(f"d{i}-{time.monotonic_ns()}", p, SamplingParams(max_tokens=new, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.scheduler.seqs.values()):
        engine.step()
    engine.step()
    walls = []
    replays = runner.graphs.replays if runner.graphs is not None else 0
    runner.execute_step = timed
    try:
        for _ in range(min(48, new - 8)):
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1e3)
    finally:
        runner.execute_step = inner
    replayed = (runner.graphs.replays if runner.graphs is not None else 0) - replays
    while engine.has_unfinished():
        engine.step()
    walls.sort()
    spent.sort()
    return {
        "median_ms": walls[len(walls) // 2],
        "runner_ms": spent[len(spent) // 2],
        "min_ms": walls[0],
        "graph_replays": replayed,
        "steps": len(walls),
    }


def profile_step(engine, c: int, prompt_len: int, vocab: int) -> list[dict]:
    """Kernel time by name over 4 eager decode steps at concurrency c."""
    from omnistage.services.thinker.engine.sequence import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(13)
    graphs, engine.runner.graphs = engine.runner.graphs, None
    try:
        for i in range(c):
            engine.add_prompt(
                f"p{i}",
                torch.randint(2, vocab - 1, (prompt_len,), generator=gen).tolist(),
                SamplingParams(max_tokens=16, ignore_eos=True),
            )
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(4):
                engine.step()
            torch.cuda.synchronize()
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.graphs = graphs
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", 0) or getattr(ev, "cuda_time_total", 0)
        if dev_us > 0 and ev.key and not ev.key.startswith(("ProfilerStep", "aten::")):
            rows.append({"kernel": ev.key[:80], "calls": ev.count, "ms_per_step": dev_us / 4 / 1e3})
    rows.sort(key=lambda r: -r["ms_per_step"])
    print(f"[profile] c={c} eager decode step, top kernels:", flush=True)
    for r in rows[:15]:
        print(f"  {r['ms_per_step']:8.3f} ms  x{r['calls'] // 4:<4d} {r['kernel']}", flush=True)
    return rows[:25]


def hf_model(shape: dict):
    import transformers

    cfg = transformers.Glm4MoeConfig(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        num_key_value_heads=shape["num_key_value_heads"],
        head_dim=shape["head_dim"],
        hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 2400000.0, "partial_rotary_factor": 0.5},
        moe_intermediate_size=shape["moe_intermediate_size"],
        num_experts_per_tok=shape["num_experts_per_tok"],
        n_shared_experts=shape["num_shared_experts"],
        n_routed_experts=shape["num_experts"],
        routed_scaling_factor=2.5,
        n_group=shape["n_group"],
        topk_group=shape["topk_group"],
        first_k_dense_replace=shape["first_k_dense_replace"],
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=False,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
    )
    with torch.device("cuda"):
        model = transformers.Glm4MoeForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def sweep_hf(shape: dict, concurrency: list[int], prompt_len: int, new: int) -> dict[int, dict]:
    model = hf_model(shape)
    gen = torch.Generator().manual_seed(7)
    rows = {}

    def run(ids, n, model=model):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    for c in concurrency:
        ids = torch.randint(2, shape["vocab_size"] - 1, (c, prompt_len), generator=gen).cuda()
        run(ids[:1], 4)
        t1, tn = run(ids, 1), run(ids, new)
        step_ms = (tn - t1) / (new - 1) * 1e3
        rows[c] = {"step_ms": step_ms, "tok_s": c * 1e3 / step_ms}
        print(f"[transformers] c={c} step {step_ms:.2f} ms, {c * 1e3 / step_ms:.1f} tok/s", flush=True)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def floor_ms(shape: dict, c: int, ctx: int, bandwidth: float) -> tuple[float, float]:
    """(ms, bytes) a decode step must read at least: weights it touches + the KV it attends."""
    s, b = shape, 2
    h, layers, moe_layers = (
        s["hidden_size"],
        s["num_hidden_layers"],
        s["num_hidden_layers"] - s["first_k_dense_replace"],
    )
    d, heads, kv = s["head_dim"], s["num_attention_heads"], s["num_key_value_heads"]
    attn = h * (heads + 2 * kv) * d + heads * d * h + 2 * d + 2 * h
    dense = 3 * h * s["intermediate_size"]
    expert = 3 * h * s["moe_intermediate_size"]
    router = s["num_experts"] * h  # text tokens read the text router only
    non_expert = (
        layers * attn
        + s["first_k_dense_replace"] * dense
        + moe_layers * (router + expert * s["num_shared_experts"])
    )
    non_expert += s["vocab_size"] * h + h  # LM head + final norm
    e, k = s["num_experts"], s["num_experts_per_tok"]
    distinct = e * (1 - (1 - k / e) ** c)
    kv_bytes = c * ctx * layers * 2 * kv * d * b
    total = (non_expert + distinct * expert * moe_layers) * b + kv_bytes
    return total / bandwidth * 1e3, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--reference-concurrency", default="1,8", help="the torch kernels (slow) at these")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--correctness-steps", type=int, default=64)
    ap.add_argument("--skip", default="", help="comma list of: correctness,reference,hf,profile")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from omnistage.common.checkpoint.config_only import LING_MINI, write_config_checkpoint

    skip = set(filter(None, args.skip.split(",")))
    dev = torch.device("cuda:0")
    conc = [int(x) for x in args.concurrency.split(",")]
    ref_conc = [int(x) for x in args.reference_concurrency.split(",") if x]
    result: dict = {
        "device": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/thinker_decode.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": {"torch": torch.__version__},
    }
    try:
        import transformers
        import triton

        result["versions"].update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError as exc:
        result["versions"]["missing"] = str(exc)

    def save() -> None:  # after every section: a run stopped at its time limit keeps what it measured
        if args.out:  # a CUDA device always (checked above)
            write_result(args.out, result, gpu=True)

    bw = copy_bandwidth(dev)
    result["copy_bandwidth_gb_s"] = bw / 1e9
    print(f"[ceiling] copy {bw / 1e9:.0f} GB/s", flush=True)
    max_seqs = max(conc)
    max_len = args.prompt_len + args.new_tokens + 64
    ours: dict[int, dict] = {}
    ref: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(write_config_checkpoint(Path(d) / "ckpt", "ling-mini"))
        kv_tokens = max_seqs * max_len + 4096
        try:
            t0 = time.monotonic()
            engine = start(ckpt, "bfloat16", "cuda:0", "auto", "auto", True, max_seqs, max_len, kv_tokens)
            result["startup_s"] = time.monotonic() - t0
            print(f"[ours] started in {result['startup_s']:.1f}s", flush=True)
            ours = sweep_ours(engine, conc, args.prompt_len, args.new_tokens, LING_MINI["vocab_size"])
            result["ours"] = ours
            save()
            if "profile" not in skip:
                result["profile"] = {
                    c: profile_step(engine, c, args.prompt_len, LING_MINI["vocab_size"])
                    for c in (1, min(32, max_seqs))
                }
            if "reference" not in skip and ref_conc:
                from omnistage.services.thinker.models.layers.backends import Backends, install_backends

                engine.runner.graphs = None
                install_backends(engine.runner.model, Backends("torch", "torch"))
                ref = sweep_ours(engine, ref_conc, args.prompt_len, args.new_tokens, LING_MINI["vocab_size"])
            release(engine)
            del engine
        except Exception:
            result["ours_error"] = traceback.format_exc()
            print(result["ours_error"], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    hf: dict[int, dict] = {}
    if "hf" not in skip:
        try:
            hf = sweep_hf(LING_MINI, conc, args.prompt_len, args.new_tokens)
        except Exception:
            result["hf_error"] = traceback.format_exc()
            print(result["hf_error"], flush=True)
    save()
    if "correctness" not in skip:
        result["correctness"] = correctness("cuda:0", args.correctness_steps)
        save()
    rows = []
    ctx = args.prompt_len + args.new_tokens // 2
    for c in conc:
        fl_ms, fl_bytes = floor_ms(LING_MINI, c, ctx, bw)
        o, h, r = ours.get(c, {}), hf.get(c, {}), ref.get(c, {})
        rows.append(
            {
                "concurrency": c,
                "ours_tok_s": o.get("tok_s"),
                "transformers_tok_s": h.get("tok_s"),
                "floor_tok_s": c * 1e3 / fl_ms,
                "step_ms": o.get("step_ms"),
                "floor_step_ms": fl_ms,
                "floor_bytes": fl_bytes,
                "transformers_step_ms": h.get("step_ms"),
                "reference_kernels_tok_s": r.get("tok_s"),
                "ours_e2e_tok_s": o.get("e2e_tok_s"),
            }
        )
    result["rows"] = rows
    print(
        "\n| c | ours tok/s | step ms | transformers tok/s | ratio | floor tok/s | % of floor | torch kernels tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        o, h, f = row["ours_tok_s"], row["transformers_tok_s"], row["floor_tok_s"]
        fmt = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
        print(
            f"| {row['concurrency']} | {fmt(o)} | {fmt(row['step_ms'], 2)} | {fmt(h)} | "
            f"{fmt(o / h if o and h else None, 2)}x | {fmt(f)} | {fmt(100 * o / f if o else None)} % | "
            f"{fmt(row['reference_kernels_tok_s'])} |"
        )
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
