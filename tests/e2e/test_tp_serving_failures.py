"""A thinker rank that dies (SIGKILL) or stops answering (SIGSTOP) while requests stream, through
`omnistage serve` (thinker TP over gloo + gateway): every client gets UNAVAILABLE naming the rank
within seconds, `serve` exits non-zero naming the dead rank, and no process is left behind.

Rank 0 used to wait inside the collective until the `loading_weights` deadline (900 s) while every
stream hung; a SIGSTOPped rank keeps its sockets open, so gloo blocks just as NCCL does.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from omnistage.common.runtime.deadlines import Deadline
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, free_port_block, free_ports

pytestmark = pytest.mark.timeout(300)
START_DEADLINE_S = 150.0
STREAMS = 6
# The deploy file's TP deadlines: a silent peer is declared after 3 s, every rank gone 8 s after.
TP = {
    "failure_exit_s": 8,
    "peer_watch_interval_s": 0.2,
    "peer_timeout_s": 3,
    "serving_collective_timeout_s": 60,
}
STOP_GRACE_S = 4.0
# The deadlines of the test's waits, not claims about speed (two shared cores): far above the bounds
# under test, below what a missed fault costs (streams held until the serving collective's 60 s timeout;
# `serve` waiting for the 900 s loading_weights deadline).
STREAMS_END_DEADLINE_S = 30.0
EXIT_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp-fail") / "ckpt", seed=0)


@dataclass
class StreamResult:
    events: int = 0
    code: grpc.StatusCode | None = None
    details: str = ""


def _stream(address: str, first_event: threading.Event, out: StreamResult) -> None:
    request = omni_pb2.GenerateRequest(
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Tell a story.")])
        ],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=450, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as ch:
        try:
            # A deadline the gateway's admission (450 tokens at the measured TP=4 CPU pace) accepts: the
            # streams must be in flight when the rank is lost, not refused at arrival. On a loaded 2-core
            # host that pace was measured at ~2.2 s a token (998 s for 450: refused under 900 s); the
            # fault ends the streams long before any deadline.
            for _ in omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=3600):
                out.events += 1
                first_event.set()
            out.code = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            out.code, out.details = exc.code(), exc.details() or ""
            first_event.set()  # no event will come: the waiter reads why at once


def _serve(tmp: Path, ckpt: Path, tp_size: int) -> ServeProcess:
    gw, th = free_ports(2)
    dist = free_port_block(tp_size)
    thinker = {
        "kind": "thinker",
        "port": th,
        "tp_size": tp_size,
        "dist_port": dist,
        "drain_grace_s": 2.0,
        "tp": TP,
        "engine": {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 512},
    }
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "stop_grace_s": STOP_GRACE_S,
            "phase_deadlines_s": {"loading_weights": 120, "warming_up": 120},
        },
        # No restart: this checks how the pipeline ends (test_pipeline_resilience checks the restart).
        "supervision": {"max_restarts": 0},
        "services": {"thinker": thinker, "gateway": {"kind": "gateway", "port": gw}},
    }
    return ServeProcess(tmp, cfg, err_apart=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    "tp_size, victim, sig",
    # A killed last rank of two and a stopped middle rank of four: both ways a rank is lost, and a victim
    # that is neither rank 0 nor the last (the other pairs cost CI minutes for the same path).
    [(2, 1, signal.SIGKILL), (4, 2, signal.SIGSTOP)],
    ids=["tp2-sigkill-rank1", "tp4-sigstop-rank2"],
)
def test_a_rank_lost_while_serving_fails_every_stream_naming_it(tmp_path, ckpt, tp_size, victim, sig):
    run = _serve(tmp_path, ckpt, tp_size)
    logs = run.logs
    try:
        address = run.wait_ready(START_DEADLINE_S).address
        results = [StreamResult() for _ in range(STREAMS)]
        firsts = [threading.Event() for _ in range(STREAMS)]
        threads = [
            threading.Thread(target=_stream, args=(address, f, r), daemon=True)
            for f, r in zip(firsts, results, strict=True)
        ]
        for t in threads:
            t.start()
        for f in firsts:
            assert f.wait(60), f"a stream got no event within 60s:\n{logs()}"
        ended = [(r.code, r.details) for r in results if r.code is not None]
        assert not ended, f"streams ended before the fault: {ended}"
        os.kill(run.children()[("thinker", victim)], sig)
        deadline = Deadline(STREAMS_END_DEADLINE_S)
        for t in threads:
            t.join(deadline.remaining())
        hung = [r for r, t in zip(results, threads, strict=True) if t.is_alive()]
        assert not hung, (
            f"{len(hung)} stream(s) still open {STREAMS_END_DEADLINE_S:g}s after the fault:\n{logs()}"
        )
        for r in results:
            assert r.code == grpc.StatusCode.UNAVAILABLE, (r, logs())
            what = "died" if sig == signal.SIGKILL else "stopped answering"
            assert f"thinker rank {victim} {what} while serving (step " in r.details, (r, logs())
        code = run.wait_exit(EXIT_DEADLINE_S)
    finally:
        left = run.leftovers()
    assert code == 1, logs()
    assert not left, f"left behind: {left}"
    lines = run.err.read_text().splitlines()
    verb = "died: killed by SIGKILL" if sig == signal.SIGKILL else f"failed: rank {victim} stopped answering"
    assert any(line.startswith(f"omnistage: thinker r{victim} {verb}") for line in lines), lines[-20:]
