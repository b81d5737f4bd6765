"""Image-generation speed at the real Ming sizes with random weights (not a test).

    source bench/device_env.sh            # on a lent GPU machine
    python bench/imagegen_speed.py [--sizes 512,1024] [--concurrency 1,2,4,8] [--steps 30] [--fbcache 0.05]
    python bench/imagegen_speed.py --tiny  # CPU, tiny models: a smoke run

Builds the connector (proj_in 4096→1536, Qwen2-1.5B body, proj_out 1536→2560), the Z-Image DiT
(dim 3840, 30 layers, 2 + 2 refiners, 30 heads, caption 2560) and the 16-channel KL VAE
(Flux/Z-Image: channels 128/256/512/512) straight on the device in bf16 (fp32 on CPU) with random
weights; the shapes marked unconfirmed in ming.md (§6.2, §9) are listed in the output. Measures,
through the service's own pipeline and runner (no gRPC): one request phase by phase (seconds
per image, denoising steps/s); images/s with 1, 2, 4, 8 requests batched step by step; the connector,
VAE decode and VAE encode (edit) times; one DiT forward of ours against diffusers'
`ZImageTransformer2DModel` holding the same weights at the same shapes (the bar to beat; "not
available" when diffusers is not installed), with the largest output difference. Guidance 2.0 (two
DiT rows per request), the release's 30 steps (the last, sigma 0 → 0, needs no forward). Our DiT
forward is timed with its default kernels (the fused Triton ones on CUDA) and with the torch path
(`ours_torch_ms`). `--fbcache T` also generates the largest size with the first-block cache at
threshold T and records its time, reused forwards and largest pixel difference against the exact
image. `--concurrency ''` skips the batched rows. Prints markdown tables; writes JSON
({device, date, command, rows: [{size, ours_forward_ms, diffusers_forward_ms, image_s, steps}], and
every measurement in detail}) to $OUT/imagegen_speed.json (or --out) when set. A configuration that
runs out of memory is reported as OOM and larger ones are skipped.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import shlex
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
from omnistage.common.bench_results import write_result
from omnistage.common.checkpoint.tiny_imagegen import CAP_DIM, TINY_CONNECTOR, TINY_DIT, TINY_VAE
from omnistage.common.runtime.device_loop import DeviceLoop
from omnistage.services.imagegen.models.config import (
    ConnectorConfig,
    DiTConfig,
    ImageGenModelConfig,
    MlpConfig,
    SchedulerConfig,
    VaeConfig,
)
from omnistage.services.imagegen.models.loader import build_models, random_init
from omnistage.services.imagegen.pipeline import GenerationSpec, ImagePipeline
from omnistage.services.imagegen.runner import Failed, Finished, ImageGenRunner, Job

GiB = 1 << 30
SCHEDULER = SchedulerConfig(shift=3.0, use_dynamic_shifting=True)
REAL = ImageGenModelConfig(
    mlp=MlpConfig(),  # 16x16 queries, 2560-wide conditioning, identity wrapper MLP, ×1000 norm
    connector=ConnectorConfig(),  # Qwen2-1.5B: 1536 wide, 28 layers, 12/2 heads, 8960 MLP
    dit=DiTConfig(),  # Z-Image defaults: 3840, 30 layers, 2 + 2 refiners, 30 heads, axes (32, 48, 48)
    vae=VaeConfig(
        use_quant_conv=False, use_post_quant_conv=False, scaling_factor=0.3611, shift_factor=0.1159
    ),
    scheduler=SCHEDULER,
    thinker_hidden=4096,
)
UNCONFIRMED = [
    "transformer/config.json: assumed the default Z-Image 6B shape (ming.md 6.2 [unconf])",
    "vae/config.json: assumed the Flux / Z-Image 16-channel AutoencoderKL, scaling 0.3611, shift 0.1159 [unconf]",
    "scheduler/scheduler_config.json: use_dynamic_shifting and shift [unconf] (speed does not depend on them)",
    "connector/: Qwen2-1.5B config [3p]",
]


def _tuple(d: dict[str, Any]) -> dict[str, Any]:
    return {k: tuple(v) if isinstance(v, list) else v for k, v in d.items()}


TINY = ImageGenModelConfig(
    mlp=MlpConfig(diffusion_c_input_dim=CAP_DIM),
    connector=ConnectorConfig(**TINY_CONNECTOR),
    dit=DiTConfig(**_tuple(TINY_DIT)),
    vae=VaeConfig(**{k: v for k, v in _tuple(TINY_VAE).items() if k not in ("sample_size", "force_upcast")}),
    scheduler=SCHEDULER,
    thinker_hidden=256,
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    return round(torch.cuda.max_memory_allocated(device) / GiB, 2) if device.type == "cuda" else 0.0


def _spec(cfg: ImageGenModelConfig, size: int, steps: int, seed: int, edit: bool = False) -> GenerationSpec:
    condition = torch.randn(
        cfg.mlp.num_queries, cfg.thinker_hidden, generator=torch.Generator().manual_seed(seed)
    )
    reference = None
    if edit:
        reference = torch.randint(
            0, 256, (size, size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8
        ).numpy()
    return GenerationSpec(condition, (size, size), steps, 2.0, seed, reference)


def single(pipeline: ImagePipeline, size: int, steps: int, pixels: list | None = None) -> dict[str, Any]:
    """One request alone, phase by phase: conditioning + noise, denoising, VAE decode (the image appended
    to `pixels` when given)."""
    cfg, dev = pipeline.models.config, pipeline.device
    _peak_reset(dev)
    state, prep_s = _timed(dev, lambda: pipeline.prepare(_spec(cfg, size, steps, 0)))

    def denoise() -> None:
        while not state.done:
            pipeline.step([state])

    _, denoise_s = _timed(dev, denoise)
    image, decode_s = _timed(dev, lambda: pipeline.decode(state))
    if pixels is not None:
        pixels.append((image, state))
    total = prep_s + denoise_s + decode_s
    return {
        "size": size,
        "concurrency": 1,
        "steps": steps,
        "seconds_per_image": round(total, 3),
        "images_s": round(1 / total, 3),
        "steps_s": round(steps / denoise_s, 2),
        "forward_ms": round(1000 * denoise_s / max(state.forwards, 1), 1),
        "prepare_ms": round(1000 * prep_s, 1),
        "vae_decode_ms": round(1000 * decode_s, 1),
        "peak_gib": _peak_gib(dev),
    }


def batched(pipeline: ImagePipeline, size: int, steps: int, concurrency: int) -> dict[str, Any]:
    """`concurrency` requests submitted at once to the runner: one DiT forward per step for all."""
    cfg, dev = pipeline.models.config, pipeline.device
    runner = ImageGenRunner(pipeline, name="bench")
    loop = DeviceLoop("bench", runner)
    done = threading.Semaphore(0)
    errors: list[BaseException] = []

    def on_event(ev: object) -> None:
        if isinstance(ev, Failed):
            errors.append(ev.error)
        if isinstance(ev, Finished | Failed):
            done.release()

    _peak_reset(dev)
    loop.start()
    try:
        specs = [_spec(cfg, size, steps, seed) for seed in range(concurrency)]
        _sync(dev)
        t0 = time.perf_counter()
        for spec in specs:
            loop.admit(lambda spec=spec: runner.put(Job(spec, on_event, lambda: None)))
        for _ in specs:
            if not done.acquire(timeout=3600):
                raise TimeoutError("bench: a batched request did not finish within an hour")
        _sync(dev)
        wall = time.perf_counter() - t0
    finally:
        loop.stop()
    if errors:
        raise errors[0]
    return {
        "size": size,
        "concurrency": concurrency,
        "steps": steps,
        "seconds_per_image": round(wall / concurrency, 3),
        "images_s": round(concurrency / wall, 3),
        "steps_s": round(concurrency * steps / wall, 2),
        "forward_ms": round(1000 * wall / max(loop.steps, 1), 1),
        "largest_batch": loop.largest_batch,
        "peak_gib": _peak_gib(dev),
    }


def components(pipeline: ImagePipeline, size: int, iters: int) -> dict[str, Any]:
    """Connector forward, VAE decode and VAE encode (an edit's reference) at one size, median of `iters`."""
    cfg, dev, models = pipeline.models.config, pipeline.device, pipeline.models
    hidden = torch.randn(1, cfg.mlp.num_queries, cfg.thinker_hidden, device=dev, dtype=models.cond.dtype)
    lat = torch.randn(1, cfg.dit.in_channels, size // 8, size // 8, device=dev)
    img = torch.rand(1, 3, size, size, device=dev) * 2 - 1
    out: dict[str, Any] = {"size": size}
    with torch.inference_mode():
        for name, fn in (
            ("connector_ms", lambda: models.cond.caption(models.cond.condition(hidden))),
            ("vae_decode_ms", lambda: models.vae.decode(lat)),
            ("vae_encode_ms", lambda: models.vae.encode(img)),
        ):
            fn()
            out[name] = _median_ms(dev, fn, iters)
    return out


def _median_ms(device: torch.device, fn: Callable[[], Any], iters: int) -> float:
    return round(1000 * statistics.median(_timed(device, fn)[1] for _ in range(iters)), 1)


def _diffusers_dit(pipeline: ImagePipeline) -> Any:
    from diffusers import ZImageTransformer2DModel

    dit = pipeline.models.dit
    c = dit.cfg
    kwargs = {
        "all_patch_size": c.all_patch_size,
        "all_f_patch_size": c.all_f_patch_size,
        "in_channels": c.in_channels,
        "dim": c.dim,
        "n_layers": c.n_layers,
        "n_refiner_layers": c.n_refiner_layers,
        "n_heads": c.n_heads,
        "n_kv_heads": c.n_kv_heads,
        "norm_eps": c.norm_eps,
        "qk_norm": c.qk_norm,
        "cap_feat_dim": c.cap_feat_dim,
        "rope_theta": c.rope_theta,
        "t_scale": c.t_scale,
        "axes_dims": list(c.axes_dims),
        "axes_lens": list(c.axes_lens),
    }
    with torch.device("meta"):
        ref = ZImageTransformer2DModel(**kwargs)
    ref = ref.to(dtype=dit.dtype).to_empty(device=pipeline.device).eval().requires_grad_(False)
    ref.load_state_dict(dit.state_dict(), strict=True)  # the same parameter names: the same weights
    return ref


def dit_versus_diffusers(
    pipeline: ImagePipeline, sizes: list[int], rows_list: list[int], iters: int
) -> list[dict]:
    """One DiT forward of ours and of diffusers' model on the same weights and inputs."""
    dev, dit = pipeline.device, pipeline.models.dit
    try:
        ref = _diffusers_dit(pipeline)
    except ImportError as exc:
        return [{"diffusers": f"not available ({exc})"}]
    import diffusers

    out = []
    for size in sizes:
        for rows in rows_list:
            x = torch.randn(rows, dit.cfg.in_channels, 1, size // 8, size // 8, device=dev, dtype=dit.dtype)
            t = torch.rand(rows, device=dev)
            cap = torch.randn(rows, 256, dit.cfg.cap_feat_dim, device=dev, dtype=dit.dtype) * 20
            row: dict[str, Any] = {"size": size, "rows": rows, "diffusers_version": diffusers.__version__}
            try:
                with torch.inference_mode():
                    ours = dit(x, t, cap)
                    theirs = torch.stack(ref(list(x.unbind(0)), t, list(cap.unbind(0)), return_dict=False)[0])
                    row["max_abs_diff"] = float((ours.float() - theirs.float()).abs().max())
                    row["ref_abs_max"] = float(theirs.float().abs().max())
                    row["ours_ms"] = _median_ms(dev, functools.partial(dit, x, t, cap), iters)
                    row["ours_kernels"] = "triton" if dit.fused_for(x) else "torch"
                    kernels, dit.kernels = dit.kernels, "torch"
                    try:
                        row["ours_torch_ms"] = _median_ms(dev, functools.partial(dit, x, t, cap), iters)
                    finally:
                        dit.kernels = kernels
                    if dev.type == "cuda":  # cuDNN's attention first (flash otherwise): which is faster here
                        from torch.nn.attention import SDPBackend

                        dit.sdpa_backends = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]
                        try:
                            cudnn = dit(x, t, cap)
                            row["cudnn_max_abs_diff"] = float((cudnn.float() - theirs.float()).abs().max())
                            row["ours_cudnn_ms"] = _median_ms(dev, functools.partial(dit, x, t, cap), iters)
                        except RuntimeError as exc:
                            row["ours_cudnn_ms"] = f"unavailable: {exc}"[:200]
                        finally:
                            dit.sdpa_backends = None
                    row["diffusers_ms"] = _median_ms(
                        dev,
                        functools.partial(ref, list(x.unbind(0)), t, list(cap.unbind(0)), return_dict=False),
                        iters,
                    )
                del ours, theirs
            except torch.OutOfMemoryError:
                row["error"] = "OOM"
                torch.cuda.empty_cache()
            out.append(row)
    return out


def _table(phases: list[dict], rows: list[dict], comps: list[dict], dit_rows: list[dict]) -> str:
    lines = [
        "| size | one request: s/image | steps/s | DiT step ms | prepare ms | VAE decode ms | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['size']} | {r['seconds_per_image']} | {r['steps_s']} | {r['forward_ms']} | {r['prepare_ms']} | "
        f"{r['vae_decode_ms']} | {r['peak_gib']} |"
        for r in phases
    ]
    lines += [
        "",
        "| size | concurrency (batched) | s/image | images/s | steps/s | DiT forward ms | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['size']} | {r['concurrency']} | {r['error']} | | | | |")
        else:
            lines.append(
                f"| {r['size']} | {r['concurrency']} | {r['seconds_per_image']} | {r['images_s']} | "
                f"{r['steps_s']} | {r['forward_ms']} | {r['peak_gib']} |"
            )
    lines += ["", "| size | connector ms | VAE decode ms | VAE encode ms |", "|---|---|---|---|"]
    lines += [
        f"| {c['size']} | {c['connector_ms']} | {c['vae_decode_ms']} | {c['vae_encode_ms']} |" for c in comps
    ]
    lines += [
        "",
        "| size | DiT rows | ours ms (kernels) | ours, torch path ms | diffusers ms | max abs diff |",
        "|---|---|---|---|---|---|",
    ]
    for d in dit_rows:
        if "diffusers" in d:
            lines.append(f"| | | | | {d['diffusers']} | |")
        elif "error" in d:
            lines.append(f"| {d['size']} | {d['rows']} | {d['error']} | | | |")
        else:
            lines.append(
                f"| {d['size']} | {d['rows']} | {d['ours_ms']} ({d['ours_kernels']}) | {d['ours_torch_ms']} | "
                f"{d['diffusers_ms']} | {d['max_abs_diff']:.3g} (of {d['ref_abs_max']:.3g}) |"
            )
    return "\n".join(lines)


def first_block_cache(pipeline: ImagePipeline, size: int, steps: int, threshold: float) -> dict[str, Any]:
    """The largest size generated exactly and with the first-block cache: time, reuse, pixel difference."""
    exact: list = []
    cached: list = []
    off = single(pipeline, size, steps, exact)
    on = single(
        ImagePipeline(pipeline.models, pipeline.device, first_block_cache=threshold), size, steps, cached
    )
    diff = (exact[0][0].int() - cached[0][0].int()).abs()
    return {
        "size": size,
        "steps": steps,
        "threshold": threshold,
        "exact_s": off["seconds_per_image"],
        "cached_s": on["seconds_per_image"],
        "forwards": cached[0][1].forwards,
        "reused_forwards": cached[0][1].block_cache[0].reused,
        "max_pixel_diff": int(diff.max()),
        "mean_pixel_diff": round(float(diff.float().mean()), 3),
    }


def compact_rows(phases: list[dict], dit_rows: list[dict]) -> list[dict]:
    """The recorded result's rows: per size, our and diffusers' DiT forward (2 rows: one request with CFG)
    and seconds per image alone."""
    out = []
    for p in phases:
        d = next(
            (d for d in dit_rows if d.get("size") == p["size"] and d.get("rows") == 2 and "ours_ms" in d), {}
        )
        out.append(
            {
                "size": p["size"],
                "ours_forward_ms": d.get("ours_ms"),
                "diffusers_forward_ms": d.get("diffusers_ms"),
                "ours_torch_forward_ms": d.get("ours_torch_ms"),
                "ours_cudnn_forward_ms": d.get("ours_cudnn_ms"),
                "image_s": p["seconds_per_image"],
                "steps": p["steps"],
            }
        )
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU (smoke run)")
    p.add_argument(
        "--sizes", default=None, help="square image sides in pixels (default 512,1024; tiny 64,128)"
    )
    p.add_argument(
        "--concurrency", default=None, help="requests batched together (default 1,2,4,8; tiny 1,2)"
    )
    p.add_argument("--steps", type=int, default=None, help="denoising steps per image (default 30; tiny 3)")
    p.add_argument(
        "--iters", type=int, default=None, help="repeats of each component timing (default 5; tiny 1)"
    )
    p.add_argument(
        "--fbcache",
        type=float,
        default=0.0,
        help="also generate the largest size with the first-block cache at this threshold (0: skip)",
    )
    p.add_argument(
        "--out", default=None, help="JSON output (default $OUT/imagegen_speed.json when $OUT is set)"
    )
    args = p.parse_args()
    tiny = args.tiny or not torch.cuda.is_available()
    sizes = [int(s) for s in (args.sizes or ("64,128" if tiny else "512,1024")).split(",")]
    conc_arg = ("1,2" if tiny else "1,2,4,8") if args.concurrency is None else args.concurrency
    conc = [int(c) for c in conc_arg.split(",") if c]
    steps = args.steps or (3 if tiny else 30)
    iters = args.iters or (1 if tiny else 5)
    device = torch.device("cpu" if tiny else "cuda")
    dtype = torch.float32 if tiny else torch.bfloat16
    cfg = TINY if tiny else REAL

    t0 = time.perf_counter()
    models = build_models(cfg, dtype=dtype, device=device)
    random_init(models)
    pipeline = ImagePipeline(models, device)
    build_s = time.perf_counter() - t0
    print(
        f"built {'tiny' if tiny else 'real-size'} models on {device} in {build_s:.1f}s "
        f"({models.weights_bytes / GiB:.2f} GiB of weights)",
        flush=True,
    )

    rows: list[dict] = []
    phases: list[dict] = []
    for size in sizes:
        single(pipeline, size, min(steps, 2))  # warm-up: kernels, allocator
        phases.append(single(pipeline, size, steps))
        print(json.dumps(phases[-1]), flush=True)
        oom = False
        for c in conc:
            if oom:
                rows.append({"size": size, "concurrency": c, "error": "skipped (OOM below)"})
                continue
            try:
                row = batched(pipeline, size, steps, c)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                row, oom = {"size": size, "concurrency": c, "error": "OOM"}, True
            rows.append(row)
            print(json.dumps(row), flush=True)
    comps = [components(pipeline, size, iters) for size in sizes]
    dit_rows = dit_versus_diffusers(pipeline, sizes, sorted({2, 2 * max(conc, default=1)}), iters)
    table = _table(phases, rows, comps, dit_rows)
    print(table)
    if not tiny:
        print("\nunconfirmed shapes:\n- " + "\n- ".join(UNCONFIRMED))
    result = {
        "device": torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": shlex.join(["python", *sys.argv]),
        "rows": compact_rows(phases, dit_rows),
        "bench": "imagegen_speed",
        "tiny": tiny,
        "torch": torch.__version__,
        "dtype": str(dtype).removeprefix("torch."),
        "steps": steps,
        "guidance_scale": 2.0,
        "weights_gib": round(models.weights_bytes / GiB, 2),
        "single": phases,
        "batched": rows,
        "components": comps,
        "dit_vs_diffusers": dit_rows,
        "first_block_cache": None,
        "unconfirmed": UNCONFIRMED,
        "table": table,
    }
    out = args.out or (
        os.path.join(os.environ["OUT"], "imagegen_speed.json") if os.environ.get("OUT") else None
    )
    gpu = device.type == "cuda" and not tiny
    if out:
        write_result(out, result, gpu=gpu, indent=2)
        print(f"wrote {out}", flush=True)
    if args.fbcache > 0:  # last, and the JSON rewritten with it: a time-out here keeps the rest
        result["first_block_cache"] = first_block_cache(pipeline, max(sizes), steps, args.fbcache)
        print(f"\nfirst-block cache: {json.dumps(result['first_block_cache'])}", flush=True)
        if out:
            write_result(out, result, gpu=gpu, indent=2)


if __name__ == "__main__":
    main()
