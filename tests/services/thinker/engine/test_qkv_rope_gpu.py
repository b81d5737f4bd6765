"""On a GPU (skipped without CUDA): the qkv projection with its q and k heads QK-normed and roped in its
launch (`resident_gemv.normed_qkv_rope`, PDL on Hopper) equals the projection then `qk_norm_rope` bit
for bit at Ling-mini's and Ming-flash TP=2's attention shapes, launch after launch on the same tickets
(left zero); and the tiny engine's greedy tokens through CUDA graphs, where one or two sequences' decode
steps take the epilogue (their attention does not fold QK-norm + rope: 16 splits), are those of the
same build with the epilogue off, and no `qk_norm_rope` launch is left in those steps. Here, not in
kernels/, whose conftest runs Triton in its interpreter."""

from __future__ import annotations

import random

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.models.layers.backends import FUSIONS_ENV, QKV_ROPE_ENV

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = {  # (hidden, query heads, KV heads): head dim 128, rotary dim 64 (partial 0.5)
    "ling-mini": (2048, 16, 4),
    "ming-flash-tp2": (4096, 16, 2),
}
CASES = [  # a weight the resident kernel holds: Ming-flash TP=2's qkv in fp32 does not fit
    ("ling-mini", torch.bfloat16),
    ("ling-mini", torch.float32),
    ("ming-flash-tp2", torch.bfloat16),
]


@pytest.mark.parametrize("name, dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_the_epilogue_is_the_projection_then_qk_norm_rope_bit_for_bit(name, dtype):
    from omnistage.services.thinker.kernels.norms import qk_norm_rope
    from omnistage.services.thinker.kernels.resident_gemv import normed_linear, normed_qkv_rope
    from omnistage.services.thinker.kernels.tickets import tickets_for
    from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

    torch.manual_seed(7)
    dev, (hidden, heads, kv_heads), dim = torch.device("cuda"), SHAPES[name], 128
    weight = (torch.randn((heads + 2 * kv_heads) * dim, hidden, device=dev) * 0.02).to(dtype)
    norm_w = (torch.rand(hidden, device=dev) + 0.5).to(dtype)
    q_w, k_w = (torch.rand(2, dim, device=dev) + 0.5).to(dtype).unbind(0)
    rotary = RotaryEmbedding(dim, 64, 10000.0, "default")
    for t in (1, 2):
        for step in range(20):  # launch after launch on the same tickets
            x = torch.randn(t, hidden, device=dev).to(dtype)
            residual = (torch.randn(t, hidden, device=dev) * 2.0 ** (step % 7 - 3)).to(dtype)
            cos, sin = rotary.cos_sin(torch.randint(0, 4096, (t,), device=dev), dtype)
            rope = ((heads, kv_heads, dim), (q_w, k_w, 1e-6, cos, sin))
            got = normed_qkv_rope(x, weight, norm_w, 1e-6, residual, rope, True)
            assert got is not None
            want, want_total = normed_linear(x, weight, norm_w, 1e-6, residual)
            q, k, _ = want.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
            qk_norm_rope(q.view(t, heads, dim), k.view(t, kv_heads, dim), q_w, k_w, 1e-6, cos, sin)
            assert torch.equal(got[0], want) and torch.equal(got[1], want_total)
    torch.cuda.synchronize()
    assert not tickets_for(dev, 1).any()


CFG = dict(block_size=16, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256, kv_tokens=4096)


def tokens(ckpt, n: int, **engine_cfg) -> list[list[int]]:
    cfg = RankConfig(str(ckpt), EngineConfig(**CFG, **engine_cfg), dtype="bfloat16", device="cuda:0")
    engine = rank0_engine(start_rank(cfg))
    rng = random.Random(11)
    prompts = [[rng.randrange(0, 900) for _ in range(rng.randrange(8, 60))] for _ in range(n)]
    out = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))]
    if engine_cfg.get("cuda_graphs", True):
        assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
    return out


@pytest.mark.parametrize("sequences", [1, 2])
def test_graphs_with_the_epilogue_give_the_tokens_of_the_same_build_without_it(
    tiny_ckpt, sequences, monkeypatch
):
    monkeypatch.setenv(FUSIONS_ENV, "on")
    monkeypatch.setenv(QKV_ROPE_ENV, "off")
    want = tokens(tiny_ckpt, sequences)
    monkeypatch.setenv(QKV_ROPE_ENV, "on")
    assert tokens(tiny_ckpt, sequences) == want


def test_an_eager_decode_step_of_one_sequence_launches_no_qk_norm_rope(tiny_ckpt, monkeypatch):
    """Eager (each launch a Python call): every forward of one or two tokens takes QK-norm + rope in
    its qkv launch -- one sequence's decode steps all do --, a longer prefill still launches it."""
    from omnistage.services.thinker.kernels import norms

    monkeypatch.setenv(FUSIONS_ENV, "on")
    monkeypatch.setenv(QKV_ROPE_ENV, "on")
    rows, launch = [], norms.qk_norm_rope
    monkeypatch.setattr(norms, "qk_norm_rope", lambda q, *a: rows.append(q.shape[0]) or launch(q, *a))
    got = tokens(tiny_ckpt, 1, cuda_graphs=False)
    assert len(got[0]) == 16
    assert rows and all(r > 2 for r in rows)  # the prompt's prefill (8 or more tokens), a layer each
