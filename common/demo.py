"""`make demo`: start the whole pipeline, send one real request per input modality, save, stop."""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from omnistage.common.wav import wav_bytes
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

PROMPT = "Hello! In one sentence, what is an omni-modal model?"
IMAGE_PROMPT = "Describe the image in detail."
AUDIO_PROMPT = "Please transcribe the audio clip."
DRAW_PROMPT = "Draw a lighthouse on a cliff at sunset."
DRAW_SIZE = (384, 256)  # width, height: multiples of 16; the tiny deploy generates at the 512 buckets


def _wait_ready(proc: subprocess.Popen, ready_file: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready_file.exists() and ready_file.read_text().strip():
            return ready_file.read_text().strip()
        if proc.poll() is not None:
            raise SystemExit(f"demo: `omnistage serve` exited with {proc.returncode} before it was ready")
        time.sleep(0.2)
    raise SystemExit(f"demo: pipeline not ready after {timeout_s:.0f}s")


def draw_image(width: int = 320, height: int = 240) -> bytes:
    """A PNG of a sun over a green hill under a blue sky, drawn with PIL."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (110, 170, 235))
    draw = ImageDraw.Draw(img)
    draw.ellipse((-width // 2, height // 2, width * 3 // 2, height * 2), fill=(60, 150, 70))
    draw.ellipse((width - 110, 25, width - 40, 95), fill=(250, 210, 60))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def synth_wav(seconds: float = 1.5, rate: int = 16000) -> bytes:
    """A mono 16-bit WAV: a rising two-tone chirp, synthesised here."""
    frames = bytearray()
    for i in range(int(seconds * rate)):
        t = i / rate
        f = 300.0 + 400.0 * t / seconds
        sample = 0.3 * math.sin(2 * math.pi * f * t) + 0.1 * math.sin(2 * math.pi * 2 * f * t)
        frames += struct.pack("<h", int(sample * 32767))
    return wav_bytes(bytes(frames), rate)


def _request(
    address: str, name: str, prompt: str, parts: list[omni_pb2.ContentPart], speech_to: Path | None = None
) -> dict:
    """Stream one request through the gateway, printing the text as it comes; its result as a dict.
    With `speech_to` the answer is spoken too, and its audio saved there as a WAV."""
    outputs = [omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech_to else [])
    request = omni_pb2.GenerateRequest(
        request_id=f"demo-{name}-1",
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[*parts, omni_pb2.ContentPart(text=prompt)])
        ],
        output_modalities=outputs,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=48),
    )
    started = time.monotonic()
    text, token_ids, finish = [], [], None
    pcm, rate = bytearray(), 0
    with grpc.insecure_channel(address) as channel:
        stub = omni_pb2_grpc.OmniStub(channel)
        print(f"demo: {name}: prompt: {prompt}")
        print(f"demo: {name}: answer (tiny random weights, so the words are noise): ", end="", flush=True)
        for event in stub.Generate(request, timeout=120):
            kind = event.WhichOneof("event")
            if kind == "text":
                print(event.text.text, end="", flush=True)
                text.append(event.text.text)
                token_ids.extend(event.text.token_ids)
            elif kind == "audio":
                pcm += event.audio.pcm16
                rate = event.audio.sample_rate_hz
            elif kind == "finish":
                finish = event.finish
    print()
    if finish is None:
        raise SystemExit(f"demo: {name}: the stream ended without a Finish event")
    speech = {}
    if speech_to is not None:
        speech = _save_speech(speech_to, bytes(pcm), rate, finish.audio)
    return {
        "modality": name,
        "prompt": prompt,
        "text": "".join(text),
        "token_ids": token_ids,
        "finish_reason": common_pb2.FinishReason.Name(finish.reason),
        "prompt_tokens": finish.usage.prompt_tokens,
        "completion_tokens": finish.usage.completion_tokens,
        "time_to_first_token_ms": round(finish.usage.time_to_first_token_ms, 1),
        "wall_s": round(time.monotonic() - started, 3),
        **speech,
    }


def _image_request(address: str, out: Path) -> dict:
    """Ask for an image (no text): progress per denoising step, then the PNG, saved as image.png."""
    from PIL import Image

    width, height = DRAW_SIZE
    request = omni_pb2.GenerateRequest(
        request_id="demo-image-1",
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=DRAW_PROMPT)])
        ],
        output_modalities=[omni_pb2.MODALITY_IMAGE],
        image=omni_pb2.ImageOptions(width=width, height=height, seed=1),
    )
    started = time.monotonic()
    steps, png, finish = 0, b"", None
    print(f"demo: image: prompt: {DRAW_PROMPT}")
    with grpc.insecure_channel(address) as channel:
        for event in omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "progress":
                steps = event.progress.done
                print(f"\rdemo: image: denoising step {steps}/{event.progress.total}", end="", flush=True)
            elif kind == "image":
                png = event.image.png
            elif kind == "finish":
                finish = event.finish
    print()
    if not png or finish is None:
        raise SystemExit("demo: image: the stream ended without an image and a Finish event")
    decoded = Image.open(io.BytesIO(png))
    if decoded.format != "PNG" or decoded.size != DRAW_SIZE:
        raise SystemExit(
            f"demo: image: got a {decoded.format} of {decoded.size}, asked for a PNG of {DRAW_SIZE}"
        )
    (out / "image.png").write_bytes(png)
    return {
        "modality": "image",
        "prompt": DRAW_PROMPT,
        "output": "image.png",
        "width": width,
        "height": height,
        "steps": steps,
        "finish_reason": common_pb2.FinishReason.Name(finish.reason),
        "prompt_tokens": finish.usage.prompt_tokens,
        "wall_s": round(time.monotonic() - started, 3),
    }


def _save_speech(path: Path, pcm: bytes, rate: int, status: omni_pb2.AudioStatus) -> dict:
    """The spoken answer as a mono 16-bit WAV at `path` (none when no audio came); what to report of it."""
    if pcm:
        path.write_bytes(wav_bytes(pcm, rate))
    outcome = omni_pb2.AudioOutcome.Name(status.outcome)
    print(
        f"demo: speech: {outcome}{' ' + status.code if status.code else ''}, "
        f"{len(pcm) / 2 / rate if rate else 0:.2f}s" + (f" saved as {path.name}" if pcm else "")
    )
    return {
        "speech": path.name if pcm else None,
        "audio_outcome": outcome,
        "audio_code": status.code,
        "audio_seconds": round(len(pcm) / 2 / rate, 3) if rate else 0.0,
        "time_to_first_audio_ms": round(status.time_to_first_audio_ms, 1),
    }


def _run_requests(address: str, out: Path) -> list[dict]:
    """The text request, then text + image and text + audio; the media are saved next to the results."""
    image, audio = draw_image(), synth_wav()
    (out / "demo-image.png").write_bytes(image)
    (out / "demo-audio.wav").write_bytes(audio)
    results = [
        _request(address, "text", PROMPT, [], speech_to=out / "demo-answer.wav"),
        _request(
            address, "text+image", IMAGE_PROMPT, [omni_pb2.ContentPart(image=omni_pb2.Media(data=image))]
        ),
        _request(
            address, "text+audio", AUDIO_PROMPT, [omni_pb2.ContentPart(audio=omni_pb2.Media(data=audio))]
        ),
    ]
    results[1]["input"], results[2]["input"] = "demo-image.png", "demo-audio.wav"
    results.append(_image_request(address, out))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="deploy/local-tiny.yaml")
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="omnistage-demo-") as tmp:
        ready_file = Path(tmp) / "ready"
        cmd = [
            sys.executable,
            "-m",
            "omnistage.common.cli",
            "serve",
            args.config,
            "--ready-file",
            str(ready_file),
        ]
        print("demo: starting:", " ".join(cmd[2:]), flush=True)
        proc = subprocess.Popen(cmd, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        try:
            address = _wait_ready(proc, ready_file, args.ready_timeout_s)
            print(f"demo: pipeline ready, gateway at {address}", flush=True)
            results = _run_requests(address, out)
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    (out / "result.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    for r in results:
        summary = {k: v for k, v in r.items() if k not in ("token_ids", "text")}
        print(f"demo: {r['modality']}: {json.dumps(summary, ensure_ascii=False)}")
    print(
        f"demo: saved {out / 'result.json'} (inputs: demo-image.png, demo-audio.wav; spoken answer: "
        f"{results[0]['speech']}; image: image.png); "
        f"pipeline stopped (exit {proc.returncode})"
    )
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
