"""`omnistage serve` with the thinker at TP 2 (gloo): a crash of rank 1 while loading weights names
`thinker r1`. (TP 2 serving the TP 1 greedy tokens through the gateway and SIGTERM stopping every rank
is checked on the TP 2 pipeline tests/e2e/test_multimodal_e2e.py starts anyway.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.serve_pipeline import ServeProcess, free_port_block, free_ports

pytestmark = pytest.mark.timeout(300)


def serve(tmp: Path, ckpt: Path, tp_size: int, fault: dict | None = None) -> ServeProcess:
    """`omnistage serve` of gateway + thinker at `tp_size` on a fresh deploy file (the launcher's
    verdicts on stderr, apart)."""
    gw, th = free_ports(2)
    dist = free_port_block(tp_size)
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


def test_crash_of_rank1_while_loading_weights_names_it(tmp_path, tiny_ckpt):
    run = serve(tmp_path, tiny_ckpt, 2, fault={"phase": "loading_weights", "action": "crash", "rank": 1})
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
