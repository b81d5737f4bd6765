"""`omnistage serve` with the thinker at TP 2 (gloo): SERVING, the same greedy tokens as TP 1 through the
gateway, SIGTERM stops every rank; a crash of rank 1 while loading weights names `thinker r1`."""

from __future__ import annotations

import signal
from pathlib import Path

import grpc
import pytest
from omnistage.v1 import common_pb2, omni_pb2, omni_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, free_ports

pytestmark = pytest.mark.timeout(300)
START_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tp") / "ckpt", seed=0)


def serve(tmp: Path, ckpt: Path, tp_size: int, fault: dict | None = None) -> ServeProcess:
    """`omnistage serve` of gateway + thinker at `tp_size` on a fresh deploy file (the launcher's
    verdicts on stderr, apart)."""
    gw, th, dist = free_ports(3)
    thinker = {
        "kind": "thinker",
        "port": th,
        "tp_size": tp_size,
        "dist_port": dist,
        "drain_grace_s": 2.0,
        "engine": {"max_num_seqs": 4, "max_num_batched_tokens": 64, "max_model_len": 256},
    }
    if fault:
        thinker["fault"] = fault
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {"stop_grace_s": 5.0, "phase_deadlines_s": {"loading_weights": 60, "warming_up": 60}},
        "services": {"thinker": thinker, "gateway": {"kind": "gateway", "port": gw}},
    }
    return ServeProcess(tmp, cfg, tag=f"-tp{tp_size}", err_apart=True)


def greedy_tokens(address: str) -> list[int]:
    request = omni_pb2.GenerateRequest(
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Count to ten.")])
        ],
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    )
    with grpc.insecure_channel(address) as ch:
        events = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=60))
    return [t for e in events if e.WhichOneof("event") == "text" for t in e.text.token_ids]


def serve_and_generate(tmp: Path, ckpt: Path, tp_size: int) -> tuple[list[int], ServeProcess]:
    run = serve(tmp, ckpt, tp_size)
    try:
        tokens = greedy_tokens(run.wait_ready(START_DEADLINE_S).address)
        pids = run.children()
        run.proc.send_signal(signal.SIGTERM)
        assert run.wait_exit() == 0, run.logs()
    finally:
        left = run.leftovers()
    assert not left, f"left behind: {left}"
    assert set(pids) == {("thinker", r) for r in range(tp_size)} | {("gateway", 0)}
    return tokens, run


@pytest.mark.slow
def test_tp2_serves_the_tp1_greedy_tokens_and_sigterm_stops_every_rank(tmp_path, ckpt):
    tp1, _ = serve_and_generate(tmp_path, ckpt, 1)
    tp2, run = serve_and_generate(tmp_path, ckpt, 2)
    assert len(tp1) == 12
    assert tp2 == tp1
    out = run.out.read_text()
    assert "thinker r1 serving" in out and "all services stopped" in out
    assert "while stopping" not in run.err.read_text()  # every rank left cleanly (exit 0)


def test_crash_of_rank1_while_loading_weights_names_it(tmp_path, ckpt):
    run = serve(tmp_path, ckpt, 2, fault={"phase": "loading_weights", "action": "crash", "rank": 1})
    try:
        assert run.wait_exit() != 0
    finally:
        left = run.leftovers()
    assert not left, f"left behind: {left}"
    lines = run.err.read_text().splitlines()
    assert any(line.startswith("omnistage: start-up failed: thinker r1 ") for line in lines), lines[-20:]
    culprit = [line for line in lines if line.startswith("thinker r1 ")]
    assert culprit and "loading_weights" in culprit[0] and "exited with code 3" in culprit[0], culprit
    assert "omnistage: ready" not in run.out.read_text()  # the gateway started beside it, never ready
