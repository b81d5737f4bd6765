"""Encoder tower throughput at the real Ming sizes with random weights, by batch size (not a test).

    source bench/device_env.sh          # on a lent GPU machine
    python bench/encoder_throughput.py [--batches 1,2,4,8,16] [--iters 5]
    python bench/encoder_throughput.py --tiny    # CPU, tiny towers: a smoke run

Builds the vision tower (ViT 27 x 1152 + merger + linear_proj to 4096) and the audio tower (Whisper
32 x 1280 + conv projector to 4096) straight on the device in bf16 (fp32 on CPU) from meta, random
weights initialised in place (no checkpoint, no media decoding: inputs are tensors). Measures one
forward per batch of images at 448² and 1024² (uint8 frames on the device, normalised and patchified
there, as the service does) and of 10 s audio clips: images/s, tokens/s, audio
seconds/s, peak device memory. Also CPU preprocessing rates (resize of an in-memory 1080p image;
log-mel of 10 s). Prints a markdown table; writes JSON to $OUT/encoder_throughput.json
(or --out) when set. A batch that runs out of memory is reported as OOM and larger ones are skipped.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from omnistage.common.bench_results import write_result
from omnistage.services.encoder import preprocess
from omnistage.services.encoder.models.audio import AudioEncoder, audio_token_count
from omnistage.services.encoder.models.config import AudioConfig, VisionConfig
from omnistage.services.encoder.models.vision import VisionEncoder
from PIL import Image

GiB = 1 << 30
REAL_VISION = VisionConfig(
    depth=27,
    hidden_size=1152,
    num_heads=16,
    intermediate_size=4304,
    out_hidden_size=4096,
    projector_size=4096,
    deepstack_visual_indexes=(8, 16, 24),
)
REAL_AUDIO = AudioConfig(n_mels=128, n_ctx=15000, n_state=1280, n_head=20, n_layer=32, projector_size=4096)
TINY_VISION = VisionConfig(
    depth=3,
    hidden_size=64,
    num_heads=4,
    intermediate_size=128,
    out_hidden_size=256,
    projector_size=256,
    num_position_embeddings=64,
)
TINY_AUDIO = AudioConfig(n_mels=128, n_ctx=1500, n_state=64, n_head=4, n_layer=2, projector_size=256)


def whisper_sinusoids(length: int, channels: int) -> torch.Tensor:
    inc = math.log(10000.0) / (channels // 2 - 1)
    t = (
        torch.arange(length, dtype=torch.float64)[:, None]
        * torch.exp(-inc * torch.arange(channels // 2))[None, :]
    )
    return torch.cat([torch.sin(t), torch.cos(t)], dim=1).float()


@torch.no_grad()
def random_init(module: torch.nn.Module, seed: int) -> None:
    """In place on the device: linear/conv weights N(0, 0.02), biases 0, LayerNorms 1/0."""
    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(seed)
    for name, p in module.named_parameters():
        if isinstance(module.get_submodule(name.rpartition(".")[0]), torch.nn.LayerNorm):
            p.fill_(1.0 if name.endswith("weight") else 0.0)
        elif name.endswith("bias"):
            p.zero_()
        else:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * 0.02)


def build(cfg_v: VisionConfig, cfg_a: AudioConfig, dtype: torch.dtype, device: torch.device):
    with torch.device("meta"):
        vision, audio = VisionEncoder(cfg_v), AudioEncoder(cfg_a)
    vision = vision.to(dtype=dtype).to_empty(device=device).eval()
    audio = audio.to(dtype=dtype).to_empty(device=device).eval()
    vision.vision.init_buffers()
    random_init(vision, 0)
    random_init(audio, 1)
    audio.audio.positional_embedding.copy_(whisper_sinusoids(cfg_a.n_ctx, cfg_a.n_state))
    return vision, audio


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> tuple[float, int]:
    """Median seconds of `fn` and the peak device memory it reached (bytes; 0 on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return statistics.median(times), peak


def vision_images(vision: VisionEncoder, cfg: VisionConfig, frames: list[torch.Tensor]) -> torch.Tensor:
    """What the service's forward does: uint8 frames on the device → normalise + patchify → one packed forward."""
    items = [preprocess.pixel_patches(f, cfg) for f in frames]
    return vision(torch.cat([p for p, _ in items]), [g for _, g in items])


def vision_rows(
    vision: VisionEncoder, cfg: VisionConfig, sizes: list[int], batches: list[int], device, iters: int
):
    rows = []
    for side in sizes:
        tokens = (side // cfg.pixels_per_token) ** 2
        for b in batches:
            frames = [
                torch.randint(0, 256, (1, side, side, 3), dtype=torch.uint8, device=device) for _ in range(b)
            ]
            forward = functools.partial(vision_images, vision, cfg, frames)
            try:
                secs, peak = timed(forward, device, iters)
            except torch.OutOfMemoryError:
                rows.append({"modality": "vision", "input": f"{side}x{side}", "batch": b, "oom": True})
                torch.cuda.empty_cache()
                break
            rows.append(
                {
                    "modality": "vision",
                    "input": f"{side}x{side}",
                    "batch": b,
                    "ms": secs * 1000,
                    "items_s": b / secs,
                    "tokens_s": b * tokens / secs,
                    "peak_gib": peak / GiB,
                }
            )
            del forward
    return rows


def audio_rows(audio: AudioEncoder, cfg: AudioConfig, seconds: float, batches: list[int], device, iters: int):
    rows = []
    frames = int(seconds * 100)
    tokens = audio_token_count(frames)
    for b in batches:
        mel = torch.randn(b, cfg.n_mels, frames, device=device)
        forward = functools.partial(audio, mel, torch.full((b,), frames, device=device))
        try:
            secs, peak = timed(forward, device, iters)
        except torch.OutOfMemoryError:
            rows.append({"modality": "audio", "input": f"{seconds:g} s", "batch": b, "oom": True})
            torch.cuda.empty_cache()
            break
        rows.append(
            {
                "modality": "audio",
                "input": f"{seconds:g} s",
                "batch": b,
                "ms": secs * 1000,
                "items_s": b / secs,
                "tokens_s": b * tokens / secs,
                "audio_s_per_s": b * seconds / secs,
                "peak_gib": peak / GiB,
            }
        )
    return rows


def preprocess_rows(sizes: list[int], seconds: float, iters: int) -> list[dict]:
    """CPU work per item the service does before a forward (no decoding: an in-memory image)."""
    rows = []
    src = Image.fromarray(np.random.default_rng(0).integers(0, 256, (1080, 1920, 3), dtype=np.uint8))
    cpu = torch.device("cpu")
    for (
        side
    ) in sizes:  # the CPU part of an image: resize to uint8 frames (normalise + patchify run on the device)
        secs, _ = timed(functools.partial(preprocess.image_frames, src, (side, side)), cpu, iters, warmup=1)
        rows.append(
            {
                "modality": "preprocess",
                "input": f"1920x1080 → {side}x{side}",
                "batch": 1,
                "ms": secs * 1000,
                "items_s": 1 / secs,
            }
        )
    wave = torch.randn(int(seconds * 16000)) * 0.1
    secs, _ = timed(lambda: preprocess.log_mel(wave, 128), cpu, iters, warmup=1)
    rows.append(
        {
            "modality": "preprocess",
            "input": f"log-mel {seconds:g} s",
            "batch": 1,
            "ms": secs * 1000,
            "items_s": 1 / secs,
            "audio_s_per_s": seconds / secs,
        }
    )
    return rows


def _cell(row: dict, key: str, fmt: str) -> str:
    return format(row[key], fmt) if key in row else ""


def table(rows: list[dict]) -> str:
    head = "| modality | input | batch | ms / forward | items/s | tokens/s | audio s/s | peak GiB |\n|---|---|---:|---:|---:|---:|---:|---:|"
    lines = [head]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['modality']} | {r['input']} | {r['batch']} | OOM | | | | |")
            continue
        cells = [
            _cell(r, "ms", ".1f"),
            _cell(r, "items_s", ".1f"),
            _cell(r, "tokens_s", ".0f"),
            _cell(r, "audio_s_per_s", ".1f"),
            _cell(r, "peak_gib", ".2f"),
        ]
        lines.append(f"| {r['modality']} | {r['input']} | {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="tiny towers on CPU (smoke run)")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--sizes", default="448,1024", help="square image sides in pixels (multiples of 32)")
    ap.add_argument("--audio-seconds", type=float, default=10.0)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--device", default="", help="default: cuda when available, else cpu")
    ap.add_argument(
        "--out", default="", help="JSON path (default $OUT/encoder_throughput.json when $OUT is set)"
    )
    args = ap.parse_args()

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() and not args.tiny else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg_v, cfg_a = (TINY_VISION, TINY_AUDIO) if args.tiny else (REAL_VISION, REAL_AUDIO)
    batches = [int(b) for b in args.batches.split(",")]
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.tiny:
        batches, sizes, args.iters = [b for b in batches if b <= 4], [128, 256], min(args.iters, 2)

    started = time.perf_counter()
    vision, audio = build(cfg_v, cfg_a, dtype, device)
    weights = {
        name: sum(p.numel() * p.element_size() for p in m.parameters())
        for name, m in (("vision", vision), ("audio", audio))
    }
    with torch.inference_mode():
        rows = vision_rows(vision, cfg_v, sizes, batches, device, args.iters)
        rows += audio_rows(audio, cfg_a, args.audio_seconds, batches, device, args.iters)
    rows += preprocess_rows(sizes, args.audio_seconds, args.iters)

    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU x{torch.get_num_threads()} threads"
    )
    print(
        f"encoder towers ({'tiny' if args.tiny else 'real sizes'}, random weights), {name}, {dtype}, "
        f"torch {torch.__version__}; weights: vision {weights['vision'] / GiB:.2f} GiB, audio "
        f"{weights['audio'] / GiB:.2f} GiB; median of {args.iters}"
    )
    print(table(rows))
    summary = {
        "device": name,
        "dtype": str(dtype),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "tiny": args.tiny,
        "iters": args.iters,
        "weights_bytes": weights,
        "rows": rows,
        "elapsed_s": time.perf_counter() - started,
        "date": time.strftime("%Y-%m-%d"),
    }
    out = args.out or (
        os.path.join(os.environ["OUT"], "encoder_throughput.json") if os.environ.get("OUT") else ""
    )
    if out:
        write_result(out, summary, gpu=device.type == "cuda" and not args.tiny, indent=2)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
