"""`omnistage generate`: one prompt to the gateway, the answer streamed (text, speech, an image)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import grpc
from omnistage.common.cli.flags import Subparsers, gateway_args
from omnistage.common.cli.targets import call_failure, gateway_target
from omnistage.common.cli.terminal import terminal_safe
from omnistage.common.config import ConfigError
from omnistage.common.runtime.auth import SecretError
from omnistage.v1 import common_pb2, omni_pb2

if TYPE_CHECKING:
    from omnistage.common.client import Result


class _Progress:
    """Progress of long work (image denoising steps, speech so far) on stderr: one self-overwriting
    line on a terminal (`[imagegen 12/30]`); in a log (stderr not a TTY), plain lines, at most one a
    second besides the last step (a `\r` line would be one endless line there)."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr  # the stderr of now, not of import time
        self.tty = self.stream.isatty()
        self.shown = False
        self._last_line = float("-inf")

    def update(self, stage: str, done: int, total: int) -> None:
        self.show(f"[{stage} {done}/{total}]" if total else f"[{stage} {done}]", last=0 < total <= done)

    def show(self, text: str, *, last: bool = False) -> None:
        if self.tty:
            self.stream.write("\r" + text)
            self.shown = True
        elif last or time.monotonic() - self._last_line >= 1.0:
            self.stream.write(text + "\n")
            self._last_line = time.monotonic()
        self.stream.flush()

    def end(self) -> None:
        if self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False


def _image_options(args: argparse.Namespace) -> omni_pb2.ImageOptions | None:
    if not args.image_out:
        return None
    options = omni_pb2.ImageOptions(steps=args.image_steps, guidance_scale=args.guidance_scale)
    if args.image_size:
        w, sep, h = args.image_size.lower().partition("x")
        if not (sep and w.isdigit() and h.isdigit()):
            raise ValueError(f"--image-size: expected WIDTHxHEIGHT, got {args.image_size!r}")
        options.width, options.height = int(w), int(h)
    if args.seed is not None:
        options.seed = args.seed
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from omnistage.common.client import Result

    try:
        address, creds, metadata = gateway_target(args)
        request = _generate_request(args)
    except (ConfigError, SecretError, OSError, ValueError) as exc:
        print(f"omnistage: {exc}", file=sys.stderr)
        return 2
    result = Result()
    progress = _Progress()
    try:
        _stream_answer(args, address, creds, metadata, request, result, progress)
    except grpc.RpcError as exc:
        progress.end()
        print("\n" + call_failure("generate", exc, address), file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the channel is closed on the way out, which cancels the request
        print("\nomnistage: interrupted", file=sys.stderr)
        return 130
    progress.end()
    print()
    finish = result.finish
    if finish is None:
        print("omnistage: the stream ended without a finish event", file=sys.stderr)
        return 1
    status = _write_answer_files(args, result, finish)
    u = finish.usage
    print(
        f"[finish: {common_pb2.FinishReason.Name(finish.reason).removeprefix('FINISH_REASON_').lower()}, "
        f"prompt_tokens={u.prompt_tokens}, completion_tokens={u.completion_tokens}, "
        f"ttft={u.time_to_first_token_ms:.1f}ms{', ' + finish.message if finish.message else ''}]"
    )
    return 1 if finish.reason == common_pb2.FINISH_REASON_ERROR else status


def _generate_request(args: argparse.Namespace) -> omni_pb2.GenerateRequest:
    """The GenerateRequest of `generate`'s flags: text always, audio with --speak, an image with --image-out."""
    from omnistage.common.client import build_request

    modalities = ["text"] + (["audio"] if args.speak else []) + (["image"] if args.image_out else [])
    return build_request(
        args.prompt,
        images=args.image,
        audios=args.audio,
        videos=args.video,
        modalities=modalities,
        voice=args.voice,
        image=_image_options(args),
        system_prompt=args.system_prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        stop=args.stop,
    )


def _stream_answer(
    args: argparse.Namespace,
    address: str,
    creds: grpc.ChannelCredentials | None,
    metadata: tuple,
    request: omni_pb2.GenerateRequest,
    result: Result,
    progress: _Progress,
) -> None:
    """Call Generate and show the answer as it comes: text on stdout, progress and speech length on stderr.

    Every event is also added to `result`, which the caller writes out once the stream ends.
    """
    from omnistage.common.client import OmniClient

    with OmniClient(address, credentials=creds, metadata=metadata, timeout_s=args.timeout_s) as client:
        for event in client.generate(request=request):
            kind = event.WhichOneof("event")
            if kind == "text":
                progress.end()
                sys.stdout.write(terminal_safe(event.text.text))
                sys.stdout.flush()
            elif kind == "progress":
                progress.update(event.progress.stage, event.progress.done, event.progress.total)
            elif kind == "audio" and args.speak:
                seconds = (
                    (len(result.pcm16) + len(event.audio.pcm16)) / 2 / max(1, event.audio.sample_rate_hz)
                )
                progress.show(f"[speech {seconds:.1f} s]")
            result.add(event)


def _write_answer_files(args: argparse.Namespace, result: Result, finish: omni_pb2.Finish) -> int:
    """Write the speech (--speak) and image (--image-out) files, one line each on stderr; 1 if no image came."""
    status = 0
    if args.speak:
        Path(args.speak).write_bytes(result.wav())
        a = finish.audio
        outcome = omni_pb2.AudioOutcome.Name(a.outcome).removeprefix("AUDIO_OUTCOME_").lower()
        seconds = len(result.pcm16) / 2 / max(1, result.sample_rate_hz or a.sample_rate_hz or 1)
        print(
            f"[speech: {outcome}, {seconds:.2f} s written to {args.speak}"
            + (f", {a.code}: {a.message}" if a.code else "")
            + "]",
            file=sys.stderr,
        )
    if args.image_out:
        if result.images:
            Path(args.image_out).write_bytes(result.png())
            img = result.images[0]
            print(f"[image: {img.width}x{img.height} written to {args.image_out}]", file=sys.stderr)
        else:
            print("omnistage: no image in the answer", file=sys.stderr)
            status = 1
    return status


def add_parsers(sub: Subparsers) -> None:
    p = sub.add_parser("generate", help="send one text prompt to the gateway and stream the answer")
    gateway_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--image", action="append", default=[], metavar="FILE", help="an input image (repeatable)")
    p.add_argument(
        "--audio", action="append", default=[], metavar="FILE", help="an input audio clip (repeatable)"
    )
    p.add_argument("--video", action="append", default=[], metavar="FILE", help="an input video (repeatable)")
    p.add_argument(
        "--speak", metavar="OUT.wav", help="also speak the answer (MODALITY_AUDIO) into this WAV file"
    )
    p.add_argument("--voice", default="", help="preset voice of --speak (default: the talker's)")
    p.add_argument(
        "--image-out", metavar="OUT.png", help="also generate an image (MODALITY_IMAGE) into this PNG"
    )
    p.add_argument(
        "--image-size", default="", metavar="WxH", help="size of --image-out (default: the stage's)"
    )
    p.add_argument(
        "--image-steps", type=int, default=0, help="denoising steps of --image-out (0: the stage's)"
    )
    p.add_argument(
        "--guidance-scale", type=float, default=0.0, help="guidance of --image-out (0: the stage's)"
    )
    p.add_argument("--system-prompt", default="")
    p.add_argument("--max-tokens", type=int, default=0, help="0: the server's default")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.0, help="0: off")
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampling (and of the image's noise)")
    p.set_defaults(fn=cmd_generate)
