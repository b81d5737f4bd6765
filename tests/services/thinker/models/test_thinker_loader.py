"""load_model: key/shape validation naming keys, dtype kept, progress per shard, TP slicing math."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, shard_files
from omnistage.services.thinker.models.layers.embed_head import ParallelLMHead, VocabParallelEmbedding
from omnistage.services.thinker.models.layers.linear import QKVParallelLinear
from omnistage.services.thinker.models.layers.parallel import TPGroup
from omnistage.services.thinker.models.loader import load_model
from safetensors.torch import save_file


def _edit(src: Path, dst: Path, change) -> Path:
    """Copy a checkpoint, letting `change(tensors)` edit the first shard that holds thinker keys."""
    shutil.copytree(src, dst)
    shard = shard_files(dst)[0]
    tensors = dict(iter_tensors(shard))
    change(tensors)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard.name}
    index["weight_map"].update({k: shard.name for k in tensors})
    index_path.write_text(json.dumps(index))
    return dst


def test_missing_unexpected_and_misshaped_keys_named_in_one_error(tiny_ckpt, tmp_path):
    def change(t):
        del t["model.model.layers.0.attention.q_norm.weight"]
        t["model.model.layers.0.attention.bogus.weight"] = torch.zeros(3)
        t["model.model.layers.0.input_layernorm.weight"] = torch.zeros(7)

    bad = _edit(tiny_ckpt, tmp_path / "bad", change)
    with pytest.raises(CheckpointError) as err:
        load_model(bad, dtype=torch.float32, device="cpu")
    msg = str(err.value)
    assert "missing keys: model.model.layers.0.attention.q_norm.weight" in msg
    assert "unexpected keys: model.model.layers.0.attention.bogus.weight" in msg
    assert "mis-shaped keys: model.model.layers.0.input_layernorm.weight [7] != [256]" in msg


def test_non_thinker_keys_are_ignored(tiny_ckpt, tmp_path):
    extra = _edit(
        tiny_ckpt, tmp_path / "extra", lambda t: t.update({"vision.new_thing.weight": torch.zeros(2)})
    )
    with_extra = load_model(extra, dtype=torch.float32, device="cpu")
    plain = load_model(tiny_ckpt, dtype=torch.float32, device="cpu")
    assert not any("new_thing" in name for name in with_extra.state_dict())
    ids, positions = torch.arange(6), torch.arange(6).expand(3, -1)
    assert torch.equal(with_extra(ids, positions), plain(ids, positions))


def test_bf16_load_keeps_bf16_and_reports_progress(tiny_ckpt):
    calls: list[tuple[int, int]] = []
    model = load_model(
        tiny_ckpt, dtype=torch.bfloat16, device="cpu", progress=lambda d, t: calls.append((d, t))
    )
    n = len(shard_files(tiny_ckpt))
    assert calls == [(i, n) for i in range(n + 1)]
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not any(p.is_meta for p in model.parameters())
    stored = dict(
        iter_tensors(
            next(s for s in shard_files(tiny_ckpt) if "model.model.norm.weight" in dict(iter_tensors(s)))
        )
    )
    assert torch.equal(model.model.norm.weight, stored["model.model.norm.weight"])
    h = model(torch.arange(8), torch.arange(8).expand(3, -1))
    assert h.dtype == torch.bfloat16 and model.compute_logits(h[-1:]).dtype == torch.bfloat16  # no fp32 copy


def test_fused_experts_hold_each_checkpoint_expert(tiny_ckpt, tiny_model):
    raw = {
        k: v for s in shard_files(tiny_ckpt) for k, v in iter_tensors(s) if ".layers.2.mlp.experts.5." in k
    }
    w13, w2 = tiny_model.model.layers[2].mlp.experts.w13, tiny_model.model.layers[2].mlp.experts.w2
    inter = tiny_model.config.moe_intermediate_size
    assert torch.equal(w13[5, :inter], raw["model.model.layers.2.mlp.experts.5.gate_proj.weight"].float())
    assert torch.equal(w13[5, inter:], raw["model.model.layers.2.mlp.experts.5.up_proj.weight"].float())
    assert torch.equal(w2[5], raw["model.model.layers.2.mlp.experts.5.down_proj.weight"].float())


class _LocalTP(TPGroup):
    """A rank whose collectives are skipped so per-rank partial results can be combined by hand."""

    def all_reduce(self, x):
        return x

    def all_gather(self, x, dim=-1):
        return x


def test_vocab_parallel_padding_and_sum():
    vocab, hidden, tp = 10, 4, 4  # 3 rows per rank; the last rank holds 1 row + 2 padding rows
    full = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 3, 9, 5, 42, -1])
    embeds, heads = [], []
    for r in range(tp):
        emb, head = (
            VocabParallelEmbedding(vocab, hidden, _LocalTP(r, tp)),
            ParallelLMHead(vocab, hidden, _LocalTP(r, tp)),
        )
        emb.weight_loader(emb.weight, full)
        head.weight_loader(head.weight, full)
        embeds.append(emb(ids))
        heads.append(torch.nn.functional.linear(torch.eye(hidden), head.weight))
    assert torch.equal(heads[-1][:, 1:], torch.zeros(hidden, 2))
    torch.testing.assert_close(sum(embeds), full[ids.clamp(0, vocab - 1)])
    torch.testing.assert_close(torch.cat(heads, dim=-1)[:, :vocab], full.t())


class _GatheringTP(TPGroup):
    """Rank 0 of `size` whose all-gather stands every rank's part in with its own, and keeps it."""

    def all_gather(self, x, dim=-1):
        self.gathered = torch.cat([x] * self.size, dim=dim)
        return self.gathered


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_lm_head_gives_a_view_of_the_gathered_logits_in_the_weights_dtype(dtype):
    """No cast and no copy after the gather (the sampler casts where it reads values): the padding
    columns cut by a view, the values the projection's own."""
    vocab, hidden = 10, 4  # 3 rows a rank: 12 gathered columns, 2 of them padding
    tp = _GatheringTP(0, 4)
    head = ParallelLMHead(vocab, hidden, tp).to(dtype)
    head.weight_loader(head.weight, torch.randn(vocab, hidden).to(dtype))
    x = torch.randn(5, hidden).to(dtype)
    logits = head(x)
    assert logits.dtype == dtype and logits.shape == (5, vocab)
    assert logits.data_ptr() == tp.gathered.data_ptr() and logits.stride() == (12, 1)
    assert torch.equal(logits, torch.nn.functional.linear(x, head.weight).repeat(1, 4)[:, :vocab])


def test_qkv_split_replicates_kv_heads_when_fewer_than_ranks():
    d, heads, kv = 2, 4, 2
    packed = torch.arange((heads + 2 * kv) * d, dtype=torch.float32)[:, None].expand(-1, 3).contiguous()
    rows = []
    for r in range(4):
        layer = QKVParallelLinear(3, d, heads, kv, _LocalTP(r, 4))
        layer.weight_loader(layer.weight, packed)
        rows.append(layer.weight[:, 0].tolist())
    # rank r: Q head r, K head r//2, V head r//2 (Q rows 0-7, K rows 8-11, V rows 12-15).
    assert rows[0] == [0, 1, 8, 9, 12, 13] and rows[1] == [2, 3, 8, 9, 12, 13]
    assert rows[3] == [6, 7, 10, 11, 14, 15]
    with pytest.raises(ValueError, match="attention heads"):
        QKVParallelLinear(3, d, 4, 2, _LocalTP(0, 3))
