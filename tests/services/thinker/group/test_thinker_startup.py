"""The thinker service's start-up on a simulated device, TP=2, through `omnistage serve`: every rank
goes loading_weights → profiling_memory → warming_up → serving, Describe reports the measured
memory, and an OOM on rank 1 during warm-up makes the whole service fail promptly naming it."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import grpc
import pytest
from omnistage.v1 import control_pb2, control_pb2_grpc

from tests.e2e.serve_pipeline import ServeProcess, free_port_block, free_ports

MiB = 1 << 20
DEADLINE_S = 120
pytestmark = pytest.mark.timeout(300)


def _serve(tmp_path, tiny_ckpt, engine: dict | None = None, **extra) -> tuple[ServeProcess, int]:
    port, admin_port = free_ports(2)
    dist_port = free_port_block(2)
    thinker = {
        "kind": "thinker",
        "port": port,
        "admin_port": admin_port,
        "dist_port": dist_port,
        "tp_size": 2,
        "engine": {
            "max_num_seqs": 4,
            "max_num_batched_tokens": 64,
            "max_model_len": 512,
            "kv_canary_bytes": MiB,
            **(engine or {}),
        },
        "memory": {"simulated_capacity_bytes": 200 * MiB, "budget_bytes": 150 * MiB},
        **extra,
    }
    cfg = {"model": {"checkpoint": str(tiny_ckpt)}, "services": {"thinker": thinker}}
    return ServeProcess(tmp_path, cfg), admin_port


def _phases(output: str, rank: int) -> list[str]:
    return re.findall(rf"thinker\[r{rank}\] INFO phase (\w+)", output)


def _children_running(pid: int, module: str) -> list[int]:
    """The pids of `pid`'s child processes running `python -m module`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and module.encode() in argv:
            found.append(int(entry.name))
    return found


def test_every_rank_profiles_then_warms_up_then_serves(tmp_path, tiny_ckpt):
    """engine.grammar_server startup (a plain CPU's default is first use): rank 0's compile server is
    running once the service serves, no other rank starts one."""
    serve, admin_port = _serve(tmp_path, tiny_ckpt, engine={"grammar_server": "startup"})
    try:
        serve.wait_ready(DEADLINE_S)
        ranks = serve.children()
        grammar_server = "omnistage.services.thinker.engine.grammar_server"
        assert len(_children_running(ranks[("thinker", 0)], grammar_server)) == 1
        assert not _children_running(ranks[("thinker", 1)], grammar_server)
        with grpc.insecure_channel(f"127.0.0.1:{admin_port}") as ch:  # Control is on the admin port only
            desc = control_pb2_grpc.ControlStub(ch).Describe(control_pb2.DescribeRequest(), timeout=5)
        (mem,) = desc.memory
        assert mem.budget_bytes == 150 * MiB
        assert mem.kv_cache_bytes > 100 * MiB and mem.activation_peak_bytes > 0 and mem.weights_bytes > 0
        assert mem.total_bytes <= mem.budget_bytes
        steps = [(t.sequences, t.context_tokens) for t in desc.limits.decode_step_times]
        assert steps == [(4, 16), (4, 512)]  # timed on both ranks in step, reported by rank 0
        assert all(t.seconds > 0 for t in desc.limits.decode_step_times)
    finally:
        serve.proc.send_signal(signal.SIGTERM)
        code = serve.wait_exit()
    output = serve.out.read_text()
    want = ["loading_weights", "profiling_memory", "warming_up", "serving"]
    for rank in (0, 1):
        seen = [p for p in _phases(output, rank) if p in want]
        assert seen == want, (rank, _phases(output, rank))
        # The group agreed on its all-reduce at start-up, each rank saying which and why: the default
        # (engine.tp_allreduce auto) falls back to torch.distributed on a CPU.
        why = "tp all-reduce: torch.distributed for every message: rank 0: device cpu: the peer path needs CUDA GPUs"
        assert f"thinker[r{rank}] INFO {why}" in output, output[-3000:]
    assert code == 0, output[-3000:]


@pytest.mark.parametrize("bad_rank", [1, 0])
def test_an_oom_on_one_rank_in_warm_up_fails_the_service_naming_it(tmp_path, tiny_ckpt, bad_rank):
    """The fault strikes as warming_up begins: on a plain CPU (no simulated device) the ranks come to it
    without the KV auto-profile, which the test above runs and this one would only pay for."""
    fault = {"phase": "warming_up", "action": "oom", "rank": bad_rank}
    serve, _ = _serve(tmp_path, tiny_ckpt, fault=fault, memory={})
    code = serve.wait_exit(DEADLINE_S)
    output = serve.out.read_text()
    assert code != 0, output[-3000:]
    assert f"rank {bad_rank} failed in warming_up: SimulatedOOM" in output, output[-3000:]
    # The launcher's headline blames the rank that failed, not the peer that copied its diagnostic
    # (rank 0 used to say "failed" only after waiting for the others' acknowledgements).
    assert f"start-up failed: thinker r{bad_rank} failed" in output, output[-3000:]
