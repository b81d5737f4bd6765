"""GPU correctness of issue 21's fast paths against the torch references (not a test; run by
bench/speech_image_gpu.sh before the benchmarks).

    source bench/device_env.sh; python3 bench/speech_image_gpu_check.py      # a CUDA machine, bf16
    python bench/speech_image_gpu_check.py --tiny                           # CPU smoke: tiny sizes, fp32

Checks, each printed as one JSON line with its numbers and `ok`:
- talker: the LM decode, the CFM sample (+ aggregator, stop head) and the VAE decoder's backbone at
  the release sizes through
  captured CUDA graphs, through the same static buffers without capture, and eagerly, at batches 1,
  3, 8 and 16 (buckets 1, 4, 8, 16) with rows at different cache positions. Graphs on/off
  (captured vs uncaptured static) must be identical; static vs eager equal to bf16 rounding (padding
  changes the GEMM shapes); no host sync inside the graph path's decode and sample (CUDA's sync
  debug mode). Also the graph pool's size, and a whole engine run (two staggered streams) with graphs
  on and off, whose steady step syncs the host at most twice (stop probabilities, audio).
- DiT kernels: the fused Triton norm + modulation, norm + gate + residual and QK-norm + rope at the
  release widths (3840, heads of 128) against the torch maths, both measured against an fp32
  reference (the kernels must be at least about as accurate); and a 2-layer DiT at the release
  width with the kernels against its torch path.
- vision: packed images and a video through flash varlen attention (cu_seqlens) against the
  equal-length segment path and the block-diagonal-mask reference.
Exit status 1 when any check fails (the benchmarks still run in the script).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import talker_speech  # noqa: E402 - the bench's model builders
from omnistage.services.talker.model_runner import TalkerRunner  # noqa: E402
from omnistage.services.talker.models.qwen2 import Rows  # noqa: E402
from omnistage.services.talker.request_flow import JobDone, SegmentJob, TalkerEngine  # noqa: E402

FAILED: list[str] = []


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def report(name: str, ok: bool, **numbers) -> None:
    print(json.dumps({"check": name, "ok": ok, **numbers}), flush=True)
    if not ok:
        FAILED.append(name)


def talker_checks(tiny: bool, device: str, dtype: torch.dtype) -> None:
    config = talker_speech.TINY if tiny else talker_speech.REAL
    models = talker_speech.build(config, device, dtype)
    cap, max_len = (4, 64) if tiny else (16, 256)
    capture = device == "cuda"
    before = torch.cuda.memory_allocated() if capture else 0
    runners = {
        "eager": TalkerRunner(models, cap, max_len, 64),
        "static": TalkerRunner(models, cap, max_len, 64, graphs=True, capture=False),
        "graphs": TalkerRunner(models, cap, max_len, 64, graphs=True, capture=capture),
    }
    graphs = runners["graphs"].static
    assert graphs is not None
    t0 = time.perf_counter()
    made = graphs.capture_all()
    pool = (torch.cuda.memory_allocated() - before) if capture else 0
    report(
        "talker_capture",
        made > 0 or not capture,
        graphs=made,
        seconds=round(time.perf_counter() - t0, 2),
        runners_and_pool_mib=round(pool / 2**20, 1),
    )
    hidden = config.llm.hidden_size
    gen = torch.Generator(device=device).manual_seed(0)
    prompt = torch.randn(10 + cap, hidden, generator=gen, device=device).to(dtype)
    with torch.no_grad():
        for slot in range(cap):
            for r in runners.values():
                r.prefill(slot, prompt[: 10 + slot])
        for n in (1, 3, 4) if tiny else (1, 3, 8, 16):
            slots = list(range(n))
            positions = [10 + s for s in slots]
            x = torch.randn(n, hidden, generator=gen, device=device).to(dtype)
            history = torch.randn(
                n, config.history_patch_size, config.latent_dim, generator=gen, device=device
            )
            outs = {}
            syncs = 0
            for name, r in runners.items():
                gens = [torch.Generator(device=device).manual_seed(100 + i) for i in range(n)]
                with count_syncs(device) as counted:
                    h = r.decode(slots, positions, x)
                    sample = r.sample(h, history, gens)
                if name == "graphs":
                    syncs = len(counted)
                outs[name] = (h, *sample)
            names = ("hidden", "patch", "next_input", "stop")
            on_off = {k: rel(a, b) for k, a, b in zip(names, outs["graphs"], outs["static"], strict=True)}
            vs_eager = {k: rel(a, b) for k, a, b in zip(names, outs["static"], outs["eager"], strict=True)}
            exact = all(torch.equal(a, b) for a, b in zip(outs["graphs"], outs["static"], strict=True))
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            report(
                f"talker_step_b{n}",
                max(on_off.values()) <= 1e-6 and max(vs_eager.values()) <= tol and not syncs,
                graphs_on_off_identical=exact,
                graphs_on_off_rel=on_off,
                static_vs_eager_rel=vs_eager,
                host_syncs_in_decode_and_sample=syncs,
            )
        # The VAE decoder's backbone: a first step's 14 frames and a last step's 18 (width buckets 16, 32).
        stack = models.vae.decoder.decoder
        for lengths in ([14] * cap, [18] * (cap // 2)):
            n = len(lengths)
            x = torch.randn(n, max(lengths), stack.shape.hidden_size, generator=gen, device=device).to(dtype)
            slots, starts = list(range(n)), [0] * n
            with count_syncs(device) as counted:
                got = runners["graphs"].static.vae_backbone(x, slots, starts, lengths)
            static = runners["static"].static.vae_backbone(x, slots, starts, lengths)
            want = stack(x, runners["eager"].vae_cache, Rows.of(slots, starts, lengths, device))
            tol = 1e-5 if dtype == torch.float32 else 3e-2
            report(
                f"talker_vae_backbone_w{max(lengths)}",
                rel(got, static) <= 1e-6 and rel(static, want) <= tol and not counted,
                graphs_on_off_identical=torch.equal(got, static),
                graphs_on_off_rel=rel(got, static),
                static_vs_eager_rel=rel(static, want),
                host_syncs=len(counted),
            )
    del runners
    engine_check(models, config, device)


def talker_other_device_check(tiny: bool, device: str, dtype: torch.dtype) -> None:
    """A service's talker on cuda:1 captures from its start-up thread, whose current device is cuda:0
    (the real-size pipeline failed so: "operation not permitted when stream is capturing")."""
    import threading

    if device != "cuda" or torch.cuda.device_count() < 2:
        report("talker_capture_on_cuda1_from_a_thread", True, skipped="needs 2 GPUs")
        return
    config = talker_speech.TINY if tiny else talker_speech.REAL
    models = talker_speech.build(config, "cuda:1", dtype)
    result: dict = {}

    def run() -> None:
        try:
            runner = TalkerRunner(models, 4, 256, 64, graphs=True, capture=True)
            hidden = config.llm.hidden_size
            x = torch.randn(2, hidden, device="cuda:1").to(dtype)
            with torch.no_grad():
                for slot in range(2):
                    runner.prefill(slot, torch.randn(12, hidden, device="cuda:1").to(dtype))
                out = runner.decode([0, 1], [12, 12], x)
            torch.cuda.synchronize("cuda:1")
            result.update(ok=True, graphs=runner.static.graphs, shape=list(out.shape))
        except Exception as exc:  # noqa: BLE001 - reported
            result.update(ok=False, error=repr(exc)[:400])

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    ok = bool(result.pop("ok", False))
    report("talker_capture_on_cuda1_from_a_thread", ok, **result)


@contextlib.contextmanager
def count_syncs(device: str):
    """The host syncs (CUDA sync debug mode's warnings) inside the block, as a list of messages."""
    found: list[str] = []
    if device != "cuda":
        yield found
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield found
        finally:
            torch.cuda.set_sync_debug_mode("default")
    found += [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]


def engine_check(models, config, device: str) -> None:
    """Two streams, the second joining a step later, through the engine with graphs on and off."""
    voice, prompt = talker_speech.bench_voice(models), talker_speech.bench_prompt(config.llm.vocab_size)
    audio, step_syncs = {}, {}
    for graphs in (True, False):
        runner = TalkerRunner(
            models,
            4,
            talker_speech.PROMPT_TOKENS + 16,
            8 * config.patch_size * config.vae.patch_size,
            graphs=graphs,
        )
        if runner.static is not None:
            runner.static.capture_all()
        engine = TalkerEngine(runner, service="check")
        events: list[list] = [[], []]
        for i in range(2):
            gen = torch.Generator(device=device).manual_seed(7 + i)
            engine.submit(SegmentJob(prompt, voice, 6, gen, events[i].append, min_steps=1 << 30))
            engine.step()
        with count_syncs(device) as counted:  # a step of both streams, no admission: its host syncs
            engine.step()
        step_syncs[graphs] = len(counted)
        for _ in range(20):
            if all(any(isinstance(e, JobDone) for e in ev) for ev in events):
                break
            engine.step()
        audio[graphs] = [
            torch.cat([torch.from_numpy(e.samples) for e in ev if hasattr(e, "samples")]) for ev in events
        ]
    same_len = all(a.shape == b.shape for a, b in zip(audio[True], audio[False], strict=True))
    finite = all(bool(torch.isfinite(a).all()) for a in audio[True])
    # The stop probabilities' read and the audio's copy to the host: two per step, nothing else.
    report(
        "talker_engine_graphs_on_off",
        same_len and finite and step_syncs[True] <= 2,
        host_syncs_per_step=step_syncs,
        samples=[int(a.numel()) for a in audio[True]],
        rel=[rel(a, b) for a, b in zip(audio[True], audio[False], strict=True)] if same_len else None,
    )


def dit_checks(tiny: bool, device: str, dtype: torch.dtype) -> None:
    from omnistage.services.imagegen.models import fused
    from omnistage.services.imagegen.models.config import DiTConfig
    from omnistage.services.imagegen.models.dit import ZImageDiT

    if not fused.triton_ok():
        report("dit_kernels", False, error="triton does not import")
        return
    d, heads, n = (96, 2, 40) if tiny else (3840, 30, 1056)
    hd = d // heads
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    x, h, res = r(2, n, d, scale=3.0), r(2, n, d), r(2, n, d)
    w = (1 + torch.randn(d, generator=g, device=device) * 0.1).to(dtype)
    scale, gate = r(2, 1, d, scale=0.5), r(2, 1, d, scale=2.0)
    q, k = r(2, n, heads, hd, scale=2.0), r(2, n, heads, hd)
    angles = torch.randn(n, hd // 2, generator=g, device=device) * 3
    cos, sin = angles.cos()[None].expand(2, -1, -1), angles.sin()[None].expand(2, -1, -1)

    def f32(t):
        return t.float() if isinstance(t, torch.Tensor) else t

    cases = {
        "norm_modulate": (fused.norm_modulate, fused.norm_modulate_ref, (x, w, 1e-5, scale)),
        "norm_gate_residual": (
            fused.norm_gate_residual,
            fused.norm_gate_residual_ref,
            (res, h, w, 1e-5, gate),
        ),
        "qk_norm_rope": (
            fused.qk_norm_rope,
            functools.partial(fused.qk_norm_rope, ref=True),
            (q, k, w[:hd], w[hd : 2 * hd], 1e-5, cos, sin),
        ),
    }
    for name, (kernel, ref, args) in cases.items():
        got, want = kernel(*args), ref(*args)
        truth = ref(*[f32(a) for a in args])
        got, want, truth = ((t,) if isinstance(t, torch.Tensor) else t for t in (got, want, truth))
        err_k = max(rel(a, t) for a, t in zip(got, truth, strict=True))
        err_t = max(rel(a, t) for a, t in zip(want, truth, strict=True))
        report(
            f"dit_kernel_{name}",
            err_k <= max(1.5 * err_t, 1e-5),
            kernel_vs_fp32=err_k,
            torch_vs_fp32=err_t,
            kernel_vs_torch=max(rel(a, b) for a, b in zip(got, want, strict=True)),
        )
    cfg = DiTConfig(
        dim=d,
        n_heads=heads,
        n_kv_heads=heads,
        n_layers=2,
        n_refiner_layers=1,
        **({"axes_dims": (16, 16, 16), "cap_feat_dim": 64} if tiny else {}),
    )
    with torch.device("meta"):
        dit = ZImageDiT(cfg)
    dit = dit.to(dtype=dtype).to_empty(device=device).eval()
    dit.rope.init_buffers(cfg)
    with torch.no_grad():
        for pname, p in dit.named_parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, device=device) * (0.1 if "norm" in pname else 0.02)
                + (1.0 if "norm" in pname else 0.0)
            )
        side = 16 if tiny else 64
        xin = r(2, cfg.in_channels, 1, side, side)
        t = torch.rand(2, generator=g, device=device)
        cap = r(2, 64, cfg.cap_feat_dim, scale=3.0)
        dit.kernels = "torch"
        want = dit(xin, t, cap)
        dit.kernels = "triton"
        got = dit(xin, t, cap)
        dit.kernels = "torch"  # the reference maths in fp32
        truth = dit.float()(xin.float(), t, cap.float())
        dit.kernels = "auto"
    auto = device == "cuda"
    report(
        "dit_forward_kernels_vs_torch",
        rel(got, truth) <= max(1.5 * rel(want, truth), 1e-5),
        kernels_vs_torch=rel(got, want),
        kernels_vs_fp32=rel(got, truth),
        torch_vs_fp32=rel(want, truth),
        auto_uses_kernels=auto and dit.fused_for(xin),
    )


def vision_checks(tiny: bool, device: str, dtype: torch.dtype) -> None:
    import encoder_throughput
    from omnistage.services.encoder.models.vision import PackedLayout

    cfg = encoder_throughput.TINY_VISION if tiny else encoder_throughput.REAL_VISION
    with torch.device("meta"):
        from omnistage.services.encoder.models.vision import VisionEncoder

        enc = VisionEncoder(cfg)
    enc = enc.to(dtype=dtype).to_empty(device=device).eval()
    enc.vision.init_buffers()
    encoder_throughput.random_init(enc, 0)
    grids = [(1, 8, 8), (2, 4, 6), (1, 4, 8)] if tiny else [(1, 32, 32), (1, 16, 24), (2, 16, 16), (1, 4, 8)]
    n = sum(t * h * w for t, h, w in grids)
    patches = torch.randn(
        n, cfg.patch_dim, generator=torch.Generator(device=device).manual_seed(1), device=device
    )
    auto_kind = PackedLayout.of(grids, torch.device(device)).kind
    outs = {}
    with torch.inference_mode():
        for kind in ("segments", "mask", "auto"):
            enc.vision.attention = kind
            outs[kind] = enc(patches, grids)
    enc.vision.attention = "auto"
    tol = 1e-5 if dtype == torch.float32 else 5e-2  # 27 bf16 layers; the numbers are printed
    want_kind = "flash" if device == "cuda" else "segments"
    report(
        "vision_varlen",
        auto_kind == want_kind
        and rel(outs["auto"], outs["segments"]) <= tol
        and rel(outs["mask"], outs["segments"]) <= tol,
        auto_kind=auto_kind,
        auto_vs_segments=rel(outs["auto"], outs["segments"]),
        mask_vs_segments=rel(outs["mask"], outs["segments"]),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="tiny sizes on the CPU in fp32 (a smoke run)")
    ap.add_argument("--only", default="talker,talker1,dit,vision", help="which checks (comma-separated)")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    print(
        json.dumps(
            {
                "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__,
                "dtype": str(dtype),
            }
        ),
        flush=True,
    )
    checks = {
        "talker": talker_checks,
        "talker1": talker_other_device_check,
        "dit": dit_checks,
        "vision": vision_checks,
    }
    for name in args.only.split(","):
        try:
            checks[name](args.tiny, device, dtype)
        except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others' results
            import traceback

            traceback.print_exc()
            report(name, False, error=repr(exc))
    print(json.dumps({"failed": FAILED}), flush=True)
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
