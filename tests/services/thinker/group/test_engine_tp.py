"""TP=2/4 over gloo in separate processes: rank 0 plans (LLMEngine), workers follow; tokens equal TP=1.

A failing rank makes every rank exit promptly with one diagnostic naming it. The ranks start with the
warm-up a service runs on a plain CPU (each path once; the full warm-up is test_warmup.py's and the
simulated-device tests'): what is tested here is serving.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import random
import re

import pytest
from omnistage.common.config import EngineConfig, TPConfig
from omnistage.common.log import setup_logging
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.group.warmup import minimal_warmup_shapes

from tests.services.thinker.group import local_ranks

CFG = EngineConfig(block_size=16, max_model_len=256, max_num_batched_tokens=64)
PARAMS = [SamplingParams(max_tokens=10, ignore_eos=True)] * 5 + [
    SamplingParams(temperature=0.9, top_k=50, seed=3, max_tokens=10, ignore_eos=True)
]
DEADLINE_S = 120
# Rank 0's outcome, spawn and imports included: a hang detector (a rank 0 that ends without one is
# reported at once), below pytest-timeout's 300 s so that a hang is named by this wait.
RESULT_WAIT_S = 240


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(0, 900) for _ in range(rng.randrange(3, 100))] for _ in range(len(PARAMS))]


def _fail_after(rank: int, fail_rank: int | None, steps: int | None = None, what: str = "forward") -> None:
    """Make `fail_rank` raise after `steps` forwards (or step plan broadcasts: one call each, the
    warm-up's plans all fit one message); default: the (plain CPU's) warm-up's forwards, so the first
    serving step fails."""
    if rank != fail_rank:
        return
    if steps is None:
        steps = len(minimal_warmup_shapes(resolve_engine_config(CFG)))
    import torch.distributed as dist

    module, name = (ModelRunner, "execute_step") if what == "forward" else (dist, "broadcast")
    orig, calls = getattr(module, name), [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] > steps:
            raise RuntimeError("injected fault")
        return orig(*args, **kwargs)

    setattr(module, name, broken)


TP = TPConfig(
    startup_collective_timeout_s=60, serving_collective_timeout_s=60, failure_exit_s=10, peer_timeout_s=5
)


def _worker(fail_rank: int | None, what: str, cfg: RankConfig) -> None:
    _fail_after(cfg.rank, fail_rank, what=what)
    local_ranks.worker_main(cfg)


def _rank0(ckpt: str, world_size: int, port: int, fail_rank: int | None, what: str, out: mp.Queue) -> None:
    setup_logging("thinker", rank=0)
    _fail_after(0, fail_rank, what=what)
    cfg = RankConfig(ckpt, CFG, tp=TP, world_size=world_size, dist_port=port, full_warmup=False)
    procs = local_ranks.spawn_workers(cfg, target=functools.partial(_worker, fail_rank, what))

    def run() -> tuple[list[list[int]], list[int]]:
        engine = rank0_engine(start_rank(cfg))
        results = engine.generate(prompts(), PARAMS, timeout_s=DEADLINE_S)
        engine.shutdown()
        return [r.token_ids for r in results], local_ranks.join_workers(procs, local_ranks.EXIT_WAIT_S)

    local_ranks.report_outcome(out, run)


def run_tp(ckpt, world_size: int, fail_rank: int | None = None, what: str = "forward"):
    args = (str(ckpt), world_size, local_ranks.free_port(), fail_rank, what)
    return local_ranks.run_rank0(_rank0, args, RESULT_WAIT_S)


@pytest.fixture(scope="module")
def tp1_tokens(tiny_ckpt):
    e = rank0_engine(start_rank(RankConfig(str(tiny_ckpt), CFG, full_warmup=False)))
    return [r.token_ids for r in e.generate(prompts(), PARAMS)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_tp_equals_tp1_token_for_token(tiny_ckpt, tp1_tokens, world_size):
    status, tokens, exitcodes = run_tp(tiny_ckpt, world_size)
    assert status == "ok", f"{tokens}\n{exitcodes}"
    assert tokens == tp1_tokens
    assert exitcodes == [0] * (world_size - 1)


@pytest.mark.slow
@pytest.mark.parametrize("fail_rank, what", [(1, "forward"), (0, "forward"), (0, "broadcast")])
def test_a_failing_rank_stops_all_ranks_with_one_diagnostic(tiny_ckpt, fail_rank, what):
    """Every rank exits (run_rank0 waits for rank 0's whole process group): a worker left waiting for
    a plan fails the test. A failed step plan broadcast on rank 0 used not to be reported, and the
    worker waited for the next plan for an hour."""
    status, message, tb = run_tp(tiny_ckpt, 2, fail_rank=fail_rank, what=what)
    assert status == "error", message
    where = r"step plan \d+ broadcast" if what == "broadcast" else r"step \d+ forward"
    assert re.search(f"rank {fail_rank} failed in {where}: RuntimeError: injected fault", message), tb
