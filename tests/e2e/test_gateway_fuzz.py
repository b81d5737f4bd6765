"""Fuzzing the public API through `omnistage serve` (gateway + thinker on the tiny checkpoint).

A few hundred typed requests with hostile contents and raw byte strings (hypothesis strategies of
`load_tests/gateway_fuzz.py`, which runs 1,000 of each): every answer is a precise status with a
message, the services keep serving, nothing stays running, and no traceback reaches the logs.
"""

from __future__ import annotations

import grpc
import pytest
from omnistage.v1 import common_pb2, control_pb2, control_pb2_grpc, omni_pb2, omni_pb2_grpc

from load_tests.gateway_fuzz import run_cases
from tests.e2e.serve_pipeline import ServeProcess, free_ports

pytestmark = pytest.mark.timeout(600)
CASES = 150  # typed, and as many raw


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("fuzz")
    ckpt = write_tiny_checkpoint(root / "ckpt", seed=0)
    gw, gw_admin, th, th_admin, dist = free_ports(5)
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "services": {
            "thinker": {
                "kind": "thinker",
                "port": th,
                "admin_port": th_admin,
                "dist_port": dist,
                "engine": {
                    "max_num_seqs": 8,
                    "max_num_batched_tokens": 128,
                    "max_model_len": 256,
                    "default_max_tokens": 8,
                },
            },
            "gateway": {
                "kind": "gateway",
                "port": gw,
                "admin_port": gw_admin,
                "max_message_bytes": 1 << 20,
                "gateway": {"max_messages": 16, "max_parts_per_message": 4, "max_prompt_chars": 4000},
            },
        },
    }
    serve = ServeProcess(root, cfg).wait_ready(300)
    yield {"gateway": f"127.0.0.1:{gw}", "thinker_admin": f"127.0.0.1:{th_admin}", "log": serve.out}
    serve.stop()


def test_fuzzed_requests_get_precise_statuses_and_leave_the_pipeline_serving(pipeline):
    tally = run_cases(pipeline["gateway"], CASES, timeout_s=60.0, seed=0)
    assert not tally.bad, "\n".join(tally.bad[:10])
    assert sum(tally.counts.values()) == 2 * CASES
    assert tally.counts[("typed", "OK")] > 0, f"no fuzzed request reached the thinker: {dict(tally.counts)}"
    assert tally.counts[("raw", "INVALID_ARGUMENT")] > 0, dict(tally.counts)

    request = omni_pb2.GenerateRequest(
        messages=[
            omni_pb2.ChatMessage(role=omni_pb2.ROLE_USER, parts=[omni_pb2.ContentPart(text="Still there?")])
        ],
        sampling=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    with grpc.insecure_channel(pipeline["gateway"]) as ch:
        events = list(omni_pb2_grpc.OmniStub(ch).Generate(request, timeout=60))
    assert events[-1].finish.usage.completion_tokens == 4
    with grpc.insecure_channel(pipeline["thinker_admin"]) as ch:
        desc = control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)
    assert desc.running_requests + desc.queued_requests == 0, "a fuzzed request is still in the engine"
    log = pipeline["log"].read_text()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 : log.index("Traceback") + 2000]
