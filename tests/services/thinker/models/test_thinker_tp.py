"""TP=2 and TP=4 (gloo, one process per rank) give the TP=1 logits (fp32)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata
from omnistage.services.thinker.models.loader import load_model

from load_tests.chaos_launch import free_ports

DEADLINE_S = 120
PROMPT = [5, 100, 300, 7, 8, 900, 31, 32, 33, 34, 1100, 1150, 17, 18]
MODALITY = [0, 0, 1, 1, 1, 1, 0, 2, 2, 2, 0, 0, 1, 0]


def _run(model) -> torch.Tensor:
    """Prompt logits (mixed modalities) followed by one paged decode step's logits."""
    n = len(PROMPT)
    ids, pos = torch.tensor(PROMPT), torch.arange(n).expand(3, -1)
    block = 4
    for layer in model.attention_layers():
        layer.k_cache = torch.zeros(model.kv_cache_shape(8, block))
        layer.v_cache = torch.zeros(model.kv_cache_shape(8, block))
    table = torch.arange(8)[None]
    with attention_metadata(AttentionMetadata([n], [n], torch.arange(n), table)):
        prompt_logits = model.compute_logits(
            model(ids, pos, modality=torch.tensor(MODALITY, dtype=torch.int8))
        )
    nxt = prompt_logits[-1].argmax()[None]
    with attention_metadata(AttentionMetadata([1], [n + 1], torch.tensor([n]), table)):
        step = model.compute_logits(model(nxt, torch.full((3, 1), n)))
    return torch.cat([prompt_logits, step])


def _worker(rank: int, size: int, port: int, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=size,
        timeout=timedelta(seconds=DEADLINE_S),
    )
    try:
        model = load_model(ckpt, dtype=torch.float32, device="cpu", tp_rank=rank, tp_size=size)
        with torch.no_grad():
            logits = _run(model)
        if rank == 0:
            torch.save(logits, out)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    return free_ports(1)[0]


def _spawn(size: int, ckpt: Path, out: Path) -> None:
    ctx = mp.start_processes(
        _worker, args=(size, _free_port(), str(ckpt), str(out)), nprocs=size, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"TP={size} gloo workers did not finish within {DEADLINE_S}s")


@pytest.mark.parametrize("size", [2, 4])
def test_tp_matches_single_rank(size, tiny_ckpt, tiny_model, tmp_path):
    with torch.no_grad():
        ref = _run(tiny_model)
    for layer in tiny_model.attention_layers():
        layer.k_cache = layer.v_cache = torch.empty(0)
    out = tmp_path / f"tp{size}.pt"
    _spawn(size, tiny_ckpt, out)
    got = torch.load(out)
    assert got.shape == ref.shape == (len(PROMPT) + 1, tiny_model.config.vocab_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
