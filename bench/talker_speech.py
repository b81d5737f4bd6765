"""Talker speech throughput and latency at the real Ming talker sizes with random weights (not a test).

    source bench/device_env.sh          # on a lent GPU machine (no gRPC needed: the engine in-process)
    python bench/talker_speech.py [--concurrency 1,4,8,16] [--steps 32] [--rounds 3] [--graphs on|off|both]
    python bench/talker_speech.py --tiny    # CPU, tiny sizes: a smoke run

Builds the talker on the device from meta (bf16 on CUDA, fp32 on CPU) with random weights: the Qwen2
LM 896 x 24 (14 heads, 2 KV heads), the CFM DiT 8 x 1024 (16 heads), the aggregator (same block
shape, 8 x 1024 — unconfirmed), and the AudioVAE decoder (Qwen2 896 x 24 backbone — unconfirmed: the
release's vae/config.json is not public; ISTFT hop 882, n_fft 3528, 44.1 kHz). Each request is one
segment through `TalkerEngine` (the service's batched engine: prefill, LM decode, CFM 10 steps x
CFG 2, aggregator, stop head, streaming VAE decode per step) with a ~120-token prompt (a 3.2 s voice
prompt of 10 patches) and a fixed number of talker steps (the stop head is disabled: every request
makes --steps x 0.32 s of audio). `c` clients each send --rounds requests back to back.

Per concurrency: TTFA (submit → first audio chunk) p50/p95, real-time factor (wall / audio seconds)
mean and p95, requests/s, audio seconds per second, step time, peak device memory. `--graphs on` runs
the LM decode and CFM sample as CUDA graphs (captured before the warm-up, capture time reported;
off CUDA the same static buffers run eagerly), `off` the eager step, `both` each in turn (the
engine's production path — graphs — gives `rows`, the eager one `eager_rows`). Prints a markdown
table per mode; writes JSON ({device, date, command, rows: [{concurrency, ttfa_p50_ms, ttfa_p95_ms,
rtf_mean, req_s, step_ms, ...}], meta}) to $OUT/talker_speech.json (or --out) when set.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from omnistage.common.bench_results import write_result
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.models.config import DiTShape, Qwen2Shape, TalkerModelConfig, VAEShape
from omnistage.services.talker.models.loader import TalkerModels, build_talker
from omnistage.services.talker.models.prompt import PromptIds
from omnistage.services.talker.request_flow import JobAudio, JobDone, JobFailed, SegmentJob, TalkerEngine
from omnistage.services.talker.voice_prompt import Voice

GiB = 1 << 30
QWEN2_05B = dict(
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=4864,
    vocab_size=151936,
    rope_theta=1e6,
)
REAL = TalkerModelConfig(
    llm=Qwen2Shape(**QWEN2_05B),
    flow=DiTShape(1024, 8, 16),
    aggregator=DiTShape(1024, 8, 16),  # unconfirmed: "same block shape as the flow DiT" (third-party port)
    vae=VAEShape(
        sample_rate=44100,
        patch_size=4,
        latent_dim=64,
        enc_input_dim=882,
        enc_hop=882,
        dec_hop=882,
        encoder=Qwen2Shape(**QWEN2_05B),
        decoder=Qwen2Shape(**QWEN2_05B),
    ),  # backbones unconfirmed
)
TINY_QWEN = dict(
    hidden_size=64,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    intermediate_size=128,
    vocab_size=2048,
    rope_theta=1e6,
)
TINY = TalkerModelConfig(
    llm=Qwen2Shape(**TINY_QWEN),
    flow=DiTShape(64, 2, 4),
    aggregator=DiTShape(64, 2, 4),
    vae=VAEShape(
        sample_rate=44100,
        patch_size=4,
        latent_dim=64,
        enc_input_dim=882,
        enc_hop=882,
        dec_hop=882,
        encoder=Qwen2Shape(**{**TINY_QWEN, "num_layers": 4}),
        decoder=Qwen2Shape(**TINY_QWEN),
    ),
)
PROMPT_TOKENS = 120
PROMPT_PATCHES = 10


@torch.no_grad()
def random_init(module: torch.nn.Module, seed: int) -> None:
    """In place on the device: matrices N(0, 0.02), vectors N(0, 0.01), norm weights 1 + N(0, 0.01)."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        p.normal_(0.0, 0.02 if p.dim() > 1 else 0.01, generator=gen)
        if "norm" in name and name.endswith("weight"):
            p.add_(1.0)


def build(config: TalkerModelConfig, device: str, dtype: torch.dtype) -> TalkerModels:
    talker, vae = build_talker(config, dtype=dtype, device=device)
    random_init(talker, 0)
    random_init(vae, 1)
    return TalkerModels(config, talker, vae, prompt=None, talker_dir=Path("."))  # type: ignore[arg-type]


def bench_voice(models: TalkerModels) -> Voice:
    cfg, dev, dt = models.config, models.device, models.dtype
    gen = torch.Generator(device=dev).manual_seed(2)
    return Voice(
        "bench",
        "",
        torch.randn(cfg.llm.hidden_size, generator=gen, device=dev).to(dt),
        torch.randn(PROMPT_PATCHES * cfg.patch_size, cfg.latent_dim, generator=gen, device=dev),
        torch.randn(PROMPT_PATCHES, cfg.llm.hidden_size, generator=gen, device=dev).to(dt),
    )


def bench_prompt(vocab: int) -> PromptIds:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (PROMPT_TOKENS,), generator=g).tolist()
    return PromptIds(
        ids, speaker_position=20, audio_position=PROMPT_TOKENS - PROMPT_PATCHES, prompt_patches=PROMPT_PATCHES
    )


class Request:
    """One segment: its timings as the engine's device thread reports them."""

    def __init__(self) -> None:
        self.submitted = time.perf_counter()
        self.first_audio: float | None = None
        self.samples = 0
        self.done = threading.Event()
        self.ended: float | None = None
        self.error: BaseException | None = None

    def __call__(self, event) -> None:
        now = time.perf_counter()
        if isinstance(event, JobAudio):
            if event.samples.size and self.first_audio is None:
                self.first_audio = now
            self.samples += event.samples.size
        elif isinstance(event, JobDone | JobFailed):
            self.error = event.error if isinstance(event, JobFailed) else None
            self.ended = now
            self.done.set()


def run_level(
    engine: TalkerEngine,
    models: TalkerModels,
    voice: Voice,
    prompt: PromptIds,
    clients: int,
    rounds: int,
    steps: int,
) -> list[Request]:
    done: list[Request] = []
    lock = threading.Lock()

    def client(k: int) -> None:
        for r in range(rounds):
            req = Request()
            gen = torch.Generator(device=models.device).manual_seed(1000 * k + r)
            engine.submit(SegmentJob(prompt, voice, steps, gen, req, min_steps=1 << 30))
            if not req.done.wait(3600):
                raise TimeoutError("request did not finish within an hour")
            if req.error is not None:
                raise req.error
            with lock:
                done.append(req)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def run_mode(
    models: TalkerModels, config: TalkerModelConfig, levels: list[int], steps: int, rounds: int, graphs: bool
) -> tuple[list[dict], dict]:
    """Every concurrency level through one engine (graphs on or off); rows and how the graphs were made."""
    device = models.device
    voice, prompt = bench_voice(models), bench_prompt(config.llm.vocab_size)
    frames = steps * config.patch_size * config.vae.patch_size
    runner = TalkerRunner(models, max(levels), PROMPT_TOKENS + steps + 8, frames, graphs=graphs)
    info: dict = {"graphs": graphs}
    if runner.static is not None:
        t0 = time.perf_counter()
        info["graphs_captured"] = runner.static.capture_all()
        info["capture_s"] = round(time.perf_counter() - t0, 2)
    engine = TalkerEngine(runner, service="bench")
    engine.start()
    audio_s_per_request = steps * config.samples_per_step / config.vae.sample_rate
    rows = []
    try:
        run_level(engine, models, voice, prompt, max(levels), 1, min(steps, 4))  # warm-up at the widest batch
        run_level(engine, models, voice, prompt, 1, 1, min(steps, 4))
        for c in levels:
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            steps_before = engine.loop.steps
            start = time.perf_counter()
            reqs = run_level(engine, models, voice, prompt, c, rounds, steps)
            wall = time.perf_counter() - start
            ttfa = [1000 * (r.first_audio - r.submitted) for r in reqs]
            rtf = [(r.ended - r.submitted) / (r.samples / config.vae.sample_rate) for r in reqs]
            rows.append(
                {
                    "concurrency": c,
                    "requests": len(reqs),
                    "audio_s_per_request": audio_s_per_request,
                    "ttfa_p50_ms": statistics.median(ttfa),
                    "ttfa_p95_ms": percentile(ttfa, 0.95),
                    "rtf_mean": statistics.fmean(rtf),
                    "rtf_p95": percentile(rtf, 0.95),
                    "req_s": len(reqs) / wall,
                    "audio_s_per_s": len(reqs) * audio_s_per_request / wall,
                    "step_ms": 1000 * wall / max(1, engine.loop.steps - steps_before),
                    "peak_mem_gib": torch.cuda.max_memory_allocated() / GiB if device.type == "cuda" else 0.0,
                }
            )
    finally:
        engine.stop()
    return rows, info


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n")
    print(
        "| concurrency | requests | TTFA p50 ms | TTFA p95 ms | RTF mean | RTF p95 | req/s | audio s/s | "
        "step ms | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['concurrency']} | {r['requests']} | {r['ttfa_p50_ms']:.0f} | {r['ttfa_p95_ms']:.0f} | "
            f"{r['rtf_mean']:.3f} | {r['rtf_p95']:.3f} | {r['req_s']:.2f} | {r['audio_s_per_s']:.1f} | "
            f"{r['step_ms']:.1f} | {r['peak_mem_gib']:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes on CPU (smoke run)")
    ap.add_argument("--concurrency", default="1,4,8,16")
    ap.add_argument("--steps", type=int, default=0, help="talker steps per request (0: 32, tiny: 6)")
    ap.add_argument("--rounds", type=int, default=0, help="requests per client (0: 3, tiny: 1)")
    ap.add_argument(
        "--graphs",
        choices=("on", "off", "both"),
        default="both",
        help="CUDA-graph steps on, off (eager), or both in turn",
    )
    ap.add_argument("--out", default="", help="JSON path (default $OUT/talker_speech.json when $OUT is set)")
    args = ap.parse_args()
    levels = [int(x) for x in args.concurrency.split(",")]
    steps = args.steps or (6 if args.tiny else 32)
    rounds = args.rounds or (1 if args.tiny else 3)
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = TINY if args.tiny else REAL
    models = build(config, device, dtype)
    modes = {"on": [True], "off": [False], "both": [True, False]}[args.graphs]
    audio_s = steps * config.samples_per_step / config.vae.sample_rate
    print(
        f"talker_speech: {'tiny' if args.tiny else 'real sizes'}, {device} {dtype}, {steps} steps "
        f"({audio_s:.2f} s audio) per request, {rounds} rounds per client",
        flush=True,
    )
    out = args.out or (os.path.join(os.environ["OUT"], "talker_speech.json") if os.environ.get("OUT") else "")
    results: dict[bool, tuple[list[dict], dict]] = {}
    for graphs in modes:  # the JSON is rewritten after each mode: a later one timing out keeps the first
        results[graphs] = run_mode(models, config, levels, steps, rounds, graphs)
        print_table(f"graphs {'on' if graphs else 'off'} {results[graphs][1]}", results[graphs][0])
        if out:
            write_json(out, results, modes[0], device, dtype, args.tiny, steps, rounds)


def write_json(
    out: str,
    results: dict[bool, tuple[list[dict], dict]],
    main: bool,
    device: str,
    dtype: torch.dtype,
    tiny: bool,
    steps: int,
    rounds: int,
) -> None:
    """{device, date, command, rows (the first mode's), meta, eager_rows (with both modes)}."""
    main_rows, main_info = results[main]
    doc = {
        "device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join(["python", *sys.argv]),
        "rows": main_rows,
        "meta": {
            "dtype": str(dtype),
            "torch": torch.__version__,
            "steps": steps,
            "rounds": rounds,
            "tiny": tiny,
            "prompt_tokens": PROMPT_TOKENS,
            **main_info,
        },
    }
    if main and False in results:
        doc["eager_rows"] = results[False][0]
    write_result(out, doc, gpu=device == "cuda" and not tiny, indent=2)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()
