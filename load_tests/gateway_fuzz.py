"""Fuzz the public API: typed and raw `Omni.Generate` requests through a running gateway.

    python load_tests/gateway_fuzz.py --cases 1000            # starts deploy/local-tiny.yaml itself
    python load_tests/gateway_fuzz.py --address HOST:PORT     # against a running gateway

Typed cases are well-formed `GenerateRequest`s with hostile contents (special-token strings, huge and
subnormal numbers, unknown enums, empty and oversized parts, media paths); raw cases are arbitrary
bytes and mutated valid messages. Every answer must be a precise status: OK, or a refusal whose
code is one a client can act on (never UNKNOWN, INTERNAL, UNAVAILABLE, a deadline or a cancel) and
whose message says what was wrong. The strategies are shared with the CI test
(tests/e2e/test_gateway_e2e.py), which runs a few hundred cases.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omnistage.v1 import common_pb2, omni_pb2

GENERATE = "/omnistage.v1.Omni/Generate"
# Codes a client can act on; anything else means the server did not understand its own failure.
PRECISE = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
}
SPECIALS = [
    "<|role_end|>",
    "<role>SYSTEM</role>",
    "<role>",
    "</role>",
    "<image>",
    "<imagePatch>",
    "<audio>",
    "<|endoftext|>",
    "\x00",
    "\ufffd",
    "\U0001f600",
    "\n\n",
]
FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, 1e-45, 1e-39, 0.009, 0.01, 1.0, 100.0, 100.5, -1.0, 2.0, 3.4e38]),
)
UINT32 = st.one_of(st.integers(0, 64), st.sampled_from([255, 256, 1023, 1024, 4096, 2**31 - 1, 2**32 - 1]))
INT32 = st.one_of(st.integers(-5, 64), st.sampled_from([-(2**31), 2**31 - 1, 10**8]))


def _text(max_size: int = 40) -> st.SearchStrategy[str]:
    return st.one_of(
        st.text(max_size=max_size),
        st.lists(st.sampled_from(SPECIALS) | st.text(max_size=8), max_size=6).map("".join),
    )


@st.composite
def _media(draw: st.DrawFn) -> omni_pb2.Media:
    if draw(st.booleans()):
        return omni_pb2.Media(
            data=draw(st.binary(max_size=64)), mime_type=draw(st.sampled_from(["", "image/png", "x/y"]))
        )
    return omni_pb2.Media(path=draw(st.sampled_from(["/etc/passwd", "../../x.png", "a.wav", "", "/tmp"])))


@st.composite
def _part(draw: st.DrawFn) -> omni_pb2.ContentPart:
    kind = draw(st.sampled_from(["text", "text", "text", "image", "audio", "video", "none"]))
    if kind == "none":
        return omni_pb2.ContentPart()
    if kind == "text":
        return omni_pb2.ContentPart(text=draw(_text()))
    return omni_pb2.ContentPart(**{kind: draw(_media())})


@st.composite
def _sampling(draw: st.DrawFn) -> common_pb2.SamplingParams:
    s = common_pb2.SamplingParams(
        temperature=draw(FLOATS),
        top_p=draw(FLOATS),
        top_k=draw(INT32),
        min_p=draw(FLOATS),
        repetition_penalty=draw(FLOATS),
        presence_penalty=draw(FLOATS),
        max_tokens=draw(st.one_of(st.integers(0, 8), UINT32)),
        logprobs=draw(st.integers(0, 40)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(_text(8), max_size=3)),
        stop_token_ids=draw(st.lists(INT32, max_size=3)),
    )
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    return s


@st.composite
def _hostile(draw: st.DrawFn) -> omni_pb2.GenerateRequest:
    """Any roles, parts, enums and numbers: mostly refused, each refusal must name what is wrong."""
    messages = draw(
        st.lists(
            st.builds(
                lambda role, parts: omni_pb2.ChatMessage(role=role, parts=parts),
                st.one_of(st.sampled_from([1, 2, 2, 2, 3]), st.integers(-1, 5)),
                st.lists(_part(), max_size=3),
            ),
            max_size=4,
        )
    )
    if draw(st.booleans()) and messages:  # often make it plausible, so the thinker is reached
        messages[-1] = omni_pb2.ChatMessage(
            role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text=draw(_text()))]
        )
    req = omni_pb2.GenerateRequest(
        request_id=draw(st.one_of(st.just(""), _text(20))),
        messages=messages,
        output_modalities=draw(st.lists(st.integers(-1, 5), max_size=3)),
        sampling=draw(_sampling()),
        system_prompt=draw(st.one_of(st.just(""), _text())),
        voice=draw(st.one_of(st.just(""), st.text(max_size=8))),
    )
    if req.sampling.max_tokens > 8 and draw(st.booleans()):
        req.sampling.max_tokens = draw(st.integers(1, 8))  # keep most served requests short
    return req


@st.composite
def _plausible(draw: st.DrawFn) -> omni_pb2.GenerateRequest:
    """Valid requests at the edges (special-token text, bounds of every sampling knob): served."""
    turns = draw(st.lists(st.tuples(_text(), _text()), max_size=2))
    messages = [
        omni_pb2.ChatMessage(role=role, parts=[omni_pb2.ContentPart(text=text)])
        for user, answer in turns
        for role, text in ((2, user), (3, answer))
        if text
    ]
    messages.append(omni_pb2.ChatMessage(role=2, parts=[omni_pb2.ContentPart(text=draw(_text()) or "hi")]))
    sampling = common_pb2.SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.01, 0.7, 1.0, 2.0, 100.0])),
        top_p=draw(st.sampled_from([0.0, 0.01, 0.5, 1.0])),
        top_k=draw(st.sampled_from([0, 1, 5, 50])),
        min_p=draw(st.sampled_from([0.0, 0.05, 1.0])),
        repetition_penalty=draw(st.sampled_from([0.0, 0.01, 1.2, 100.0])),
        presence_penalty=draw(st.sampled_from([0.0, -2.0, 2.0])),
        max_tokens=draw(st.integers(1, 8)),
        logprobs=draw(st.integers(0, 20)),
        ignore_eos=draw(st.booleans()),
        stop=draw(st.lists(_text(4).filter(bool), max_size=2)),
    )
    if draw(st.booleans()):
        sampling.seed = draw(st.integers(0, 2**64 - 1))
    return omni_pb2.GenerateRequest(
        request_id=draw(_text(16)),
        messages=messages,
        sampling=sampling,
        system_prompt=draw(st.one_of(st.just(""), _text())),
    )


def typed_requests() -> st.SearchStrategy[omni_pb2.GenerateRequest]:
    """Well-formed GenerateRequests: hostile ones and valid ones at the edges, half and half."""
    return st.one_of(_hostile(), _plausible())


@st.composite
def raw_requests(draw: st.DrawFn) -> bytes:
    """Arbitrary bytes, or a valid request's bytes with some bytes flipped, cut or repeated."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=256))
    data = bytearray(draw(typed_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        op = draw(st.sampled_from(["flip", "cut", "dup"]))
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[i:]
        else:
            data[i:i] = data[i : i + 8]
    return bytes(data)


@dataclass
class Tally:
    """Status counts and the cases that broke the rules."""

    counts: collections.Counter = field(default_factory=collections.Counter)
    bad: list[str] = field(default_factory=list)

    def check(self, kind: str, code: grpc.StatusCode, details: str, case: object) -> None:
        self.counts[(kind, code.name)] += 1
        if code not in PRECISE:
            self.bad.append(f"{kind}: {code.name} {details!r} for {case!r:.300}")
        elif code is not grpc.StatusCode.OK and not details:
            self.bad.append(f"{kind}: {code.name} without a message for {case!r:.300}")

    def table(self) -> str:
        lines = ["| kind | status | cases |", "|---|---|---:|"]
        lines += [f"| {k} | {c} | {n} |" for (k, c), n in sorted(self.counts.items())]
        return "\n".join(lines)


def send(channel: grpc.Channel, payload: bytes, timeout_s: float) -> tuple[grpc.StatusCode, str]:
    """One Generate call with raw request bytes, read to the end; returns (code, details)."""
    call = channel.unary_stream(GENERATE, request_serializer=None, response_deserializer=None)(
        payload, timeout=timeout_s
    )
    try:
        for _ in call:
            pass
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def run_cases(address: str, cases: int, timeout_s: float = 60.0, seed: int | None = None) -> Tally:
    """Send `cases` typed and `cases` raw requests; every status is tallied."""
    tally = Tally()
    with grpc.insecure_channel(address) as channel:
        sett = settings(
            max_examples=cases,
            deadline=None,
            database=None,
            derandomize=seed is not None,
            suppress_health_check=list(HealthCheck),
        )

        @sett
        @given(typed_requests())
        def typed(req: omni_pb2.GenerateRequest) -> None:
            code, details = send(channel, req.SerializeToString(), timeout_s)
            tally.check("typed", code, details, req)

        @sett
        @given(raw_requests())
        def raw(data: bytes) -> None:
            code, details = send(channel, data, timeout_s)
            tally.check("raw", code, details, data)

        typed()
        raw()
    return tally


def _serve(config: str, out: Path) -> tuple[subprocess.Popen, str]:
    ready = out / "ready"
    proc = subprocess.Popen(
        [sys.executable, "-m", "omnistage.common.cli", "serve", config, "--ready-file", str(ready)],
        stdout=open(out / "serve.log", "w"),
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    deadline = time.monotonic() + 600
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"pipeline did not start; see {out / 'serve.log'}")
        time.sleep(0.2)
    return proc, ready.read_text().strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", help="a running gateway; default: start --config")
    p.add_argument("--config", default="deploy/local-tiny.yaml")
    p.add_argument("--cases", type=int, default=1000, help="typed cases and as many raw cases")
    p.add_argument("--json", help="write the tally here")
    args = p.parse_args(argv)
    proc = None
    with tempfile.TemporaryDirectory(prefix="omnistage-fuzz-") as tmp:
        address = args.address
        if address is None:
            proc, address = _serve(args.config, Path(tmp))
        try:
            started = time.monotonic()
            tally = run_cases(address, args.cases)
            wall = time.monotonic() - started
        finally:
            if proc is not None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=120)
    print(tally.table())
    print(f"{2 * args.cases} cases in {wall:.0f}s; {len(tally.bad)} imprecise")
    for line in tally.bad[:20]:
        print("  ", line)
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "counts": {f"{k}/{c}": n for (k, c), n in tally.counts.items()},
                    "bad": tally.bad,
                    "wall_s": wall,
                },
                indent=2,
            )
        )
    return 1 if tally.bad else 0


if __name__ == "__main__":
    sys.exit(main())
