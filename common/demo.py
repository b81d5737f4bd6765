"""`make demo`: start the whole pipeline, send one real request per input modality, save, stop."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TextIO

import grpc
from omnistage.common.wav import wav_bytes
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

PROMPT = "Hello! In one sentence, what is an omni-modal model?"
IMAGE_PROMPT = "Describe the image in detail."
AUDIO_PROMPT = "Please transcribe the audio clip."
DRAW_PROMPT = "Draw a lighthouse on a cliff at sunset."
DRAW_SIZE = (384, 256)  # width, height: multiples of 16; the tiny deploy generates at the 512 buckets
# The longest the demo stays silent: a line saying what it waits for comes at least this often.
HEARTBEAT_S = 4.0


class Console:
    """Every line the demo shows (its own and `serve`'s). While it waits (`waiting`), a line saying
    what for comes whenever nothing was shown for HEARTBEAT_S. On a terminal an answer streams on one
    line; in a log (stdout not a TTY) everything is plain whole lines."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty()
        self.last = time.monotonic()
        self._open = False  # a streamed line not ended yet
        self._lock = threading.Lock()

    def line(self, text: str) -> None:
        with self._lock:
            self.stream.write(("\n" if self._open else "") + text + "\n")
            self.stream.flush()
            self.last, self._open = time.monotonic(), False

    def end_line(self) -> None:
        with self._lock:
            if self._open:
                self.stream.write("\n")
                self.stream.flush()
                self.last, self._open = time.monotonic(), False

    def partial(self, text: str) -> None:
        """Text continuing the current line (a terminal only: a log gets whole lines)."""
        with self._lock:
            self.stream.write(text)
            self.stream.flush()
            self.last, self._open = time.monotonic(), True

    @contextlib.contextmanager
    def waiting(self, status: Callable[[], str]) -> Iterator[None]:
        """`demo: <status()> (N s)` whenever nothing was shown for HEARTBEAT_S, until the block ends."""
        stop, started = threading.Event(), time.monotonic()

        def watch() -> None:
            while not stop.wait(0.25):
                if time.monotonic() - self.last >= HEARTBEAT_S:
                    self.line(f"demo: {status()} ({time.monotonic() - started:.0f} s)")

        thread = threading.Thread(target=watch, name="demo-heartbeat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()


class ServeOutput:
    """`omnistage serve`'s output, relayed line by line to the console (so the heartbeat knows when it
    spoke); its last line says what start-up is at."""

    def __init__(self, proc: subprocess.Popen, console: Console) -> None:
        self.last = "(nothing yet)"
        self._thread = threading.Thread(target=self._relay, args=(proc, console), daemon=True)
        self._thread.start()

    def _relay(self, proc: subprocess.Popen, console: Console) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            self.last = raw.rstrip("\n")
            console.line(self.last)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)


def _wait_ready(
    proc: subprocess.Popen, ready_file: Path, timeout_s: float, console: Console, serve: ServeOutput
) -> str:
    deadline = time.monotonic() + timeout_s
    with console.waiting(lambda: f"the pipeline is starting; serve last said: {serve.last.strip()}"):
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


class _Answer:
    """What one request's stream brought so far: text, token ids, speech, the finish."""

    def __init__(self, name: str, spoken: bool) -> None:
        self.name, self.spoken = name, spoken
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.pcm, self.rate = bytearray(), 0
        self.finish: omni_pb2.Finish | None = None

    def add(self, event: omni_pb2.GenerateEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "text":
            self.text.append(event.text.text)
            self.token_ids.extend(event.text.token_ids)
        elif kind == "audio":
            self.pcm += event.audio.pcm16
            self.rate = event.audio.sample_rate_hz
        elif kind == "finish":
            self.finish = event.finish

    def status(self) -> str:
        """What the heartbeat says while the answer comes."""
        speech = ", no speech yet" if self.spoken else ""
        if self.rate:
            speech = f", {len(self.pcm) / 2 / self.rate:.1f} s of speech"
        return f"{self.name}: {len(self.token_ids)} tokens so far{speech}"


def _request(
    address: str,
    name: str,
    prompt: str,
    parts: list[omni_pb2.ContentPart],
    console: Console,
    speech_to: Path | None = None,
) -> dict:
    """Stream one request through the gateway, showing the text as it comes (a log: once it is all
    there); its result as a dict. With `speech_to` the answer is spoken too, its audio saved there."""
    outputs = [omni_pb2.MODALITY_TEXT] + ([omni_pb2.MODALITY_AUDIO] if speech_to else [])
    request = omni_pb2.GenerateRequest(
        request_id=f"demo-{name}-1",
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[*parts, omni_pb2.ContentPart(text=prompt)])
        ],
        output_modalities=outputs,
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=48),
    )
    started, answer = time.monotonic(), _Answer(name, speech_to is not None)
    intro = f"demo: {name}: answer (tiny random weights, so the words are noise): "
    console.line(f"demo: {name}: prompt: {prompt}")
    if console.tty:
        console.partial(intro)
    with grpc.insecure_channel(address) as channel, console.waiting(answer.status):
        for event in omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=120):
            answer.add(event)
            if console.tty and event.WhichOneof("event") == "text":
                console.partial(event.text.text)
    if console.tty:
        console.end_line()
    else:
        console.line(intro + "".join(answer.text))
    finish = answer.finish
    if finish is None:
        raise SystemExit(f"demo: {name}: the stream ended without a Finish event")
    speech = {}
    if speech_to is not None:
        speech = _save_speech(speech_to, bytes(answer.pcm), answer.rate, finish.audio, console)
    return {
        "modality": name,
        "prompt": prompt,
        "text": "".join(answer.text),
        "token_ids": answer.token_ids,
        "finish_reason": common_pb2.FinishReason.Name(finish.reason),
        "prompt_tokens": finish.usage.prompt_tokens,
        "completion_tokens": finish.usage.completion_tokens,
        "time_to_first_token_ms": round(finish.usage.time_to_first_token_ms, 1),
        "wall_s": round(time.monotonic() - started, 3),
        **speech,
    }


def _image_request(address: str, out: Path, console: Console) -> dict:
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
    steps, total, png, finish = 0, 0, b"", None
    console.line(f"demo: image: prompt: {DRAW_PROMPT}")
    status = lambda: f"image: denoising step {steps}/{total or '?'}"  # noqa: E731 - read by the heartbeat
    with grpc.insecure_channel(address) as channel, console.waiting(status):
        for event in omni_pb2_grpc.OmniStub(channel).Generate(request, timeout=300):
            kind = event.WhichOneof("event")
            if kind == "progress":
                steps, total = event.progress.done, event.progress.total
                if console.tty:  # one self-overwriting line; a log gets the heartbeat's lines
                    console.partial(f"\rdemo: {status()}")
            elif kind == "image":
                png = event.image.png
            elif kind == "finish":
                finish = event.finish
    console.line(f"demo: image: {steps} denoising steps done")
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


def _save_speech(path: Path, pcm: bytes, rate: int, status: omni_pb2.AudioStatus, console: Console) -> dict:
    """The spoken answer as a mono 16-bit WAV at `path` (none when no audio came); what to report of it."""
    if pcm:
        path.write_bytes(wav_bytes(pcm, rate))
    outcome = omni_pb2.AudioOutcome.Name(status.outcome)
    console.line(
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


def _run_requests(address: str, out: Path, console: Console) -> list[dict]:
    """The text request, then text + image and text + audio; the media are saved next to the results."""
    image, audio = draw_image(), synth_wav()
    (out / "demo-image.png").write_bytes(image)
    (out / "demo-audio.wav").write_bytes(audio)
    image_part = omni_pb2.ContentPart(image=omni_pb2.Media(data=image))
    audio_part = omni_pb2.ContentPart(audio=omni_pb2.Media(data=audio))
    results = [
        _request(address, "text", PROMPT, [], console, speech_to=out / "demo-answer.wav"),
        _request(address, "text+image", IMAGE_PROMPT, [image_part], console),
        _request(address, "text+audio", AUDIO_PROMPT, [audio_part], console),
    ]
    results[1]["input"], results[2]["input"] = "demo-image.png", "demo-audio.wav"
    results.append(_image_request(address, out, console))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="deploy/local-tiny.yaml")
    parser.add_argument("--out", default="demo-output")
    parser.add_argument("--ready-timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="passed to serve"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    console = Console()
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
        cmd += [f"--set={o}" for o in args.overrides]
        console.line("demo: starting: " + " ".join(cmd[2:]))
        proc = subprocess.Popen(
            cmd,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        serve = ServeOutput(proc, console)
        try:
            address = _wait_ready(proc, ready_file, args.ready_timeout_s, console, serve)
            console.line(f"demo: pipeline ready, gateway at {address}")
            results = _run_requests(address, out, console)
        finally:
            _stop(proc, console)
            serve.join(10)
    (out / "result.json").write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n")
    for r in results:
        summary = {k: v for k, v in r.items() if k not in ("token_ids", "text")}
        console.line(f"demo: {r['modality']}: {json.dumps(summary, ensure_ascii=False)}")
    console.line(
        f"demo: saved {out / 'result.json'} (inputs: demo-image.png, demo-audio.wav; spoken answer: "
        f"{results[0]['speech']}; image: image.png); "
        f"pipeline stopped (exit {proc.returncode})"
    )
    return 0 if proc.returncode == 0 else 1


def _stop(proc: subprocess.Popen, console: Console) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    with console.waiting(lambda: "stopping the pipeline"):
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
