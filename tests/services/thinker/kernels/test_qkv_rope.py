"""The qkv projection's QK-norm + rope epilogue (`resident_gemv.normed_qkv_rope`): its one launch equals
`normed_linear` then `qk_norm_rope` on the q and k views bit for bit (q, k, v and the residual sum;
bf16 and fp32, one and two tokens, Ling-mini's heads with a program an eighth of a head as on the GPU
and tiny ones with several heads a program, partial and full rotary, with and without the QK-norm
weights), the tickets are left zero (a second launch the same bits); the dispatch rule serves only
where the attention would launch `qk_norm_rope` itself; under TP each rank norms and ropes its own
heads; and in the tiny engine, with the decode attention not folding QK-norm + rope (as one
sequence on a GPU), the `qk_norm_rope` launches of every step go and the greedy tokens stay."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import EngineConfig
from omnistage.services.thinker.engine.cuda_graphs import DecodeGraphs
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.startup import RankConfig, rank0_engine, start_rank
from omnistage.services.thinker.kernels import norms, paged_attention, resident_gemv
from omnistage.services.thinker.kernels.norms import qk_norm_rope
from omnistage.services.thinker.kernels.resident_gemv import (
    ResidentConfig,
    normed_linear,
    normed_qkv_rope,
    rope_epilogue_applies,
)
from omnistage.services.thinker.kernels.tickets import tickets_for
from omnistage.services.thinker.models.layers.attention import QKNormRope
from omnistage.services.thinker.models.layers.backends import (
    QKV_ROPE_ENV,
    RESIDENT_ENV,
    Backends,
    install_backends,
    qkv_rope_enabled,
)
from omnistage.services.thinker.models.layers.linear import QKVParallelLinear
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding


class Case:
    """A qkv projection of `tokens` rows: x, residual, input norm weight, the qkv weight and the
    QK-norm weights (None: a model without QK norm) and the rope of the tokens' positions."""

    def __init__(self, heads, kv_heads, dim, rot, hidden, tokens, dtype, qk_norm=True, seed=0):
        torch.manual_seed(seed)
        self.heads = (heads, kv_heads, dim)
        n = (heads + 2 * kv_heads) * dim
        self.x, self.residual = (torch.randn(2, tokens, hidden) * 2).to(dtype).unbind(0)
        self.norm_w = (torch.rand(hidden) + 0.5).to(dtype)
        self.weight = (torch.randn(n, hidden) * hidden**-0.5).to(dtype)
        q_w, k_w = (torch.rand(2, dim) + 0.5).to(dtype).unbind(0) if qk_norm else (None, None)
        cos, sin = RotaryEmbedding(dim, rot, 10000.0, "default").cos_sin(torch.arange(tokens) * 37 + 5, dtype)
        self.qk_rope = QKNormRope(q_w, k_w, 1e-6, cos, sin)

    def separate(self, config=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`normed_linear` (at `config`): (its rows raw, then with `qk_norm_rope` in place on its q
        and k views, the residual sum)."""
        norm = (self.norm_w, 1e-6)
        qkv, total = resident_gemv.resident_gemv(self.x, self.weight, norm, self.residual, config)
        raw = qkv.clone()
        (heads, kv_heads, dim), t = self.heads, qkv.shape[0]
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        qk_norm_rope(q.view(t, heads, dim), k.view(t, kv_heads, dim), *self.qk_rope)
        return raw, qkv, total

    def fused(self, config=None) -> tuple[torch.Tensor, torch.Tensor]:
        norm, rope = (self.norm_w, 1e-6), (self.heads, self.qk_rope)
        return resident_gemv.resident_gemv(self.x, self.weight, norm, self.residual, config, rope)


SHAPES = {  # (query heads, KV heads, head dim, rotary dim, hidden, config)
    # Ling-mini's heads at its qkv's 8 rows a program: 16 programs a head (a smaller hidden, the
    # interpreter's time); the decode step's shape on the GPU.
    "ling-heads": (16, 4, 128, 64, 128, ResidentConfig(block_n=8, warps=4)),
    # Tiny: the default config's 128 rows a program hold 8 heads, q, k and v ones together.
    "tiny-partial": (4, 2, 16, 8, 64, None),
    "tiny-full-rope": (4, 2, 16, 16, 64, None),
    # One KV head (a TP rank's replicated one), 32 rows a program: two programs a head.
    "one-kv-head": (6, 1, 64, 32, 48, ResidentConfig(block_n=32, warps=4)),
}


BITS_CASES = [
    pytest.param(
        name, dtype, tokens, qk_norm, id=f"{name}-{dt}-{tokens}-{'qk-norm' if qk_norm else 'no-qk-norm'}"
    )
    for name in SHAPES
    for dtype, dt in [(torch.bfloat16, "bf16"), (torch.float32, "fp32")]
    for tokens in (1, 2)
    for qk_norm in ((True,) if name == "ling-heads" else (True, False))  # Ling-mini has the QK norm
]


@pytest.mark.parametrize("name, dtype, tokens, qk_norm", BITS_CASES)
def test_the_epilogue_equals_the_projection_then_qk_norm_rope_bit_for_bit(name, dtype, tokens, qk_norm):
    *heads, config = SHAPES[name]
    case = Case(*heads, tokens, dtype, qk_norm)
    raw, want, want_total = case.separate(config)
    got, total = case.fused(config)
    assert torch.equal(got, want) and torch.equal(total, want_total)
    q_k = (case.heads[0] + case.heads[1]) * case.heads[2]
    assert not torch.equal(got[:, :q_k], raw[:, :q_k])  # q and k were normed and roped
    assert torch.equal(got[:, q_k:], raw[:, q_k:])  # v as projected
    assert not tickets_for(got.device, 1).any()  # every head's last program reset its ticket
    if dtype == torch.bfloat16 and tokens == 2:  # (the interpreter's time: one launch again a shape)
        assert torch.equal(case.fused(config)[0], got)


def test_the_layers_path_without_a_residual_returns_x_as_normed_linear_does():
    case = Case(4, 2, 16, 8, 64, 2, torch.float32)
    got, x = normed_qkv_rope(case.x, case.weight, case.norm_w, 1e-6, None, (case.heads, case.qk_rope), True)
    want, _ = normed_linear(case.x, case.weight, case.norm_w, 1e-6, None)
    q_k = 6 * 16
    q, k = want[:, : 4 * 16].view(2, 4, 16), want[:, 4 * 16 : q_k].view(2, 2, 16)
    qk_norm_rope(q, k, *case.qk_rope)
    assert x is case.x and torch.equal(got, want)


def test_the_dispatch_rule():
    case = Case(4, 2, 16, 8, 64, 2, torch.float32)
    rope = (case.heads, case.qk_rope)

    def applies(x=case.x, weight=case.weight, norm_w=case.norm_w, rope=rope, apart=True) -> bool:
        return rope_epilogue_applies(x, weight, norm_w, rope, apart)

    assert applies()
    assert not applies(apart=False)  # the attention folds QK-norm + rope itself: nothing to take on
    three = torch.randn(3, 64)  # three tokens: the resident kernel does not serve them
    cos3 = torch.cat([case.qk_rope.cos, case.qk_rope.cos[:1]])
    assert not applies(x=three, rope=(case.heads, case.qk_rope._replace(cos=cos3, sin=cos3)))
    assert not applies(norm_w=case.norm_w.bfloat16())  # the norm's dtype: normed_linear's rule
    assert not applies(rope=((4, 2, 12), case.qk_rope))  # the heads do not tile the output
    odd = case.qk_rope.cos[:, :7]
    assert not applies(rope=(case.heads, case.qk_rope._replace(cos=odd, sin=odd)))  # an odd rotary dim
    assert not applies(rope=(case.heads, case.qk_rope._replace(k_weight=None)))  # one weight of two
    w24 = torch.randn((4 + 2 * 2) * 24, 64)  # head dim 24: not a power of two
    cos24 = torch.randn(2, 8)
    assert not applies(weight=w24, rope=((4, 2, 24), case.qk_rope._replace(cos=cos24, sin=cos24)))
    assert normed_qkv_rope(case.x, case.weight, case.norm_w, 1e-6, None, rope, False) is None
    with pytest.raises(ValueError, match="does not take these shapes"):
        resident_gemv.resident_gemv(case.x, case.weight, rope=((4, 2, 12), case.qk_rope))


def test_the_switch(monkeypatch):
    monkeypatch.delenv(QKV_ROPE_ENV, raising=False)
    assert not qkv_rope_enabled()
    monkeypatch.setenv(QKV_ROPE_ENV, "ON")
    assert qkv_rope_enabled()
    monkeypatch.setenv(QKV_ROPE_ENV, "1")
    with pytest.raises(ValueError, match="expected on or off"):
        qkv_rope_enabled()


@pytest.mark.parametrize("kv_heads", [4, 1], ids=["kv-split", "kv-replicated"])
def test_under_tp_each_rank_norms_and_ropes_its_own_heads(kv_heads):
    """A column-parallel rank's [q | k | v] rows are its own whole heads: its epilogue equals the
    whole projection's, normed and roped by the reference modules, at the rank's heads."""
    torch.manual_seed(3)
    hidden, heads, dim, rot = 64, 8, 16, 8
    full = torch.randn((heads + 2 * kv_heads) * dim, hidden) * 0.1
    x, residual, norm = torch.randn(1, hidden), torch.randn(1, hidden), RMSNorm(hidden, 1e-6)
    norm.weight.data = torch.rand(hidden) + 0.5
    cos, sin = RotaryEmbedding(dim, rot, 10000.0, "default").cos_sin(torch.tensor([9]), torch.float32)
    qk_rope = QKNormRope(torch.rand(dim) + 0.5, torch.rand(dim) + 0.5, 1e-6, cos, sin)
    whole = QKVParallelLinear(hidden, dim, heads, kv_heads, TPGroup())
    whole.weight_loader(whole.weight, full)
    qkv, _ = whole.normed(x, norm, residual)
    q, k = qkv[:, : heads * dim].view(1, heads, dim), qkv[:, heads * dim : (heads + kv_heads) * dim]
    want_q, want_k = qk_rope.reference(q, k.view(1, kv_heads, dim))
    for rank in range(2):
        part = QKVParallelLinear(hidden, dim, heads, kv_heads, TPGroup(rank, 2))
        part.weight_loader(part.weight, full)
        part.rope_gemv = normed_qkv_rope
        got, total, roped = part.normed_roped(x, norm, residual, qk_rope, True)
        assert roped and torch.equal(total, x + residual)
        local_q, local_kv = part.num_heads, part.num_kv_heads
        got_q = got[:, : local_q * dim].view(1, local_q, dim)
        got_k = got[:, local_q * dim : (local_q + local_kv) * dim].view(1, local_kv, dim)
        kv0 = part.kv_head_start()
        assert torch.allclose(got_q, want_q[:, rank * local_q : (rank + 1) * local_q], atol=1e-5)
        assert torch.allclose(got_k, want_k[:, kv0 : kv0 + local_kv], atol=1e-5)
        assert part.normed_roped(x, norm, residual, qk_rope, False)[2] is False  # not apart: raw


@pytest.fixture
def tiny_model(tiny_ckpt_2_layers):
    from omnistage.services.thinker.models.loader import load_model

    return load_model(str(tiny_ckpt_2_layers), dtype=torch.float32, device="cpu")


def _decode_step(layer, backends: Backends, contexts=(20, 3)) -> tuple[torch.Tensor, ...]:
    """One decode step of the attention layer `layer` (fresh caches, the same each call) installed on
    `backends`: (its output, the K and V caches after it)."""
    from omnistage.services.thinker.models.layers.attention import AttentionMetadata, attention_metadata

    install_backends(layer, backends, fuse=True)
    torch.manual_seed(4)
    attn, page = layer.attn, 16
    attn.k_cache, attn.v_cache = (torch.randn(6, page, attn.num_kv_heads, attn.head_dim) for _ in range(2))
    tables = torch.tensor([[4, 1], [2, -1]])
    slots = torch.tensor(
        [int(tables[b, (c - 1) // page]) * page + (c - 1) % page for b, c in enumerate(contexts)]
    )
    md = AttentionMetadata([1, 1], list(contexts), slots, tables, context_lens_tensor=torch.tensor(contexts))
    x, residual = torch.randn(2, 2, layer.query_key_value.weight.shape[1]).unbind(0)
    norm = RMSNorm(x.shape[1], 1e-6)
    rope = RotaryEmbedding(attn.head_dim, 64, 10000.0, "default").cos_sin(torch.tensor(contexts) - 1, x.dtype)
    with attention_metadata(md), torch.no_grad():
        out, _ = layer(x, residual, norm, rope)
    return out, attn.k_cache, attn.v_cache


def test_a_decode_step_that_takes_the_epilogue_writes_the_roped_k_as_the_separate_launch_does(
    tiny_model, monkeypatch, launches
):
    """Two sequences whose decode launch does not fold QK-norm + rope (QK_FOLD_MAX_SPLITS 0): with
    the epilogue the decode launch (ROT 0) writes the K the qkv launch normed and roped -- the
    output and both caches those of the separate `qk_norm_rope` launch bit for bit, the
    reference's within fp32 rounding -- and no `qk_norm_rope` is launched."""
    layer = tiny_model.model.layers[0].attention
    want, want_k, want_v = _decode_step(layer, Backends("torch", "torch"))
    monkeypatch.setattr(paged_attention, "QK_FOLD_MAX_SPLITS", 0)
    launches.watch(norms, "_qk_norm_rope_kernel")
    launches.watch(paged_attention, "_decode_kernel")
    got = {}
    for epilogue in ("off", "on"):
        monkeypatch.setenv(QKV_ROPE_ENV, epilogue)
        got[epilogue] = _decode_step(layer, Backends("triton", "triton"))
    assert all(torch.equal(a, b) for a, b in zip(got["on"], got["off"], strict=True))
    out, k_cache, v_cache = got["on"]
    assert torch.allclose(out, want, atol=1e-4)  # (the reference projects by F.linear: other sums)
    # the new K rows normed and roped (raw ones would be far off the reference's)
    assert torch.allclose(k_cache, want_k, atol=1e-5) and torch.allclose(v_cache, want_v, atol=1e-5)
    assert launches.names() == ["_qk_norm_rope_kernel", "_decode_kernel", "_decode_kernel"]  # off, on
    assert [rot for _, rot in launches.of("_decode_kernel")] == [0, 0]


ENGINE_CFG = dict(block_size=16, max_model_len=128, max_num_seqs=2, max_num_batched_tokens=64)
PARAMS = SamplingParams(max_tokens=3, ignore_eos=True)
PROMPT = [[17, 404]]  # two tokens: a prefill the epilogue serves, then one-sequence decode steps


@pytest.fixture(scope="module")
def reference_tokens(tiny_ckpt_2_layers):
    cfg = RankConfig(str(tiny_ckpt_2_layers), EngineConfig(**ENGINE_CFG), warmup=False)
    return [r.token_ids for r in rank0_engine(start_rank(cfg)).generate(PROMPT, PARAMS)]


@pytest.mark.parametrize("epilogue", ["on", "off"])
def test_tiny_engine_drops_each_steps_qk_norm_rope_launches_and_keeps_its_tokens(
    tiny_ckpt_2_layers, reference_tokens, epilogue, monkeypatch, launches
):
    """With the decode attention not folding QK-norm + rope (QK_FOLD_MAX_SPLITS 0: as one sequence's
    16 splits on a GPU), each layer's qkv projection takes it on: no `qk_norm_rope` launch in the
    prefill or any decode step (through the graph buffers), where with the epilogue off there is one
    a layer a step; the decode launch writes the K it is given (ROT 0) either way."""
    monkeypatch.setenv(QKV_ROPE_ENV, epilogue)
    monkeypatch.delenv(RESIDENT_ENV, raising=False)
    monkeypatch.setattr(paged_attention, "QK_FOLD_MAX_SPLITS", 0)
    for module, name in [(norms, "_qk_norm_rope_kernel"), (paged_attention, "_decode_kernel")]:
        launches.watch(module, name)
    launches.watch(resident_gemv, "_resident_gemv_kernel")
    fast = EngineConfig(attention_backend="triton", moe_backend="triton", **ENGINE_CFG)
    engine = rank0_engine(start_rank(RankConfig(str(tiny_ckpt_2_layers), fast, warmup=False)))
    runner = engine.runner
    graphs = DecodeGraphs(runner.model, 2, runner.cfg.max_blocks_per_seq, runner.device, capture=False)
    runner.use_graphs(graphs)
    steps, run = [], graphs.run

    def counted_run(plan, fill=None):
        before = len(launches.log)
        out = run(plan, fill)
        steps.append(launches.names()[before:])
        return out

    graphs.run = counted_run
    assert [r.token_ids for r in engine.generate(PROMPT, PARAMS)] == reference_tokens
    assert len(steps) == PARAMS.max_tokens - 1  # every decode step through the buffers
    qkv_rot = [rot for (grid, rot) in launches.of("_resident_gemv_kernel") if rot is not None]
    layers, forwards = 2, PARAMS.max_tokens  # the prefill and the decode steps
    per_step = [step.count("_qk_norm_rope_kernel") for step in steps]
    if epilogue == "on":
        assert per_step == [0] * len(steps) and launches.of("_qk_norm_rope_kernel") == []
        assert sorted(set(qkv_rot)) == [0, 64] and qkv_rot.count(64) == layers * forwards
    else:
        assert per_step == [layers] * len(steps) and len(launches.of("_qk_norm_rope_kernel")) == 6
        assert set(qkv_rot) == {0}
    assert [rot for _, rot in launches.of("_decode_kernel")] == [0] * layers * len(steps)
