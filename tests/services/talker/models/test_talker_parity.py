"""The talker's models against independent references on the tiny checkpoint's weights.

LM and AudioVAE decoder backbone against transformers' Qwen2Model (whole sequences and our slot
cache with batched rows at different positions, a sliding-window layer included); the ISTFT head
against torch.istft; the CFM sampler against the Euler / CFG / sway update written out here.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from omnistage.services.talker.models.qwen2 import KVSlots, Qwen2Stack, Rows
from transformers import Qwen2Config, Qwen2Model


def _hf_qwen2(config: dict, ours: Qwen2Stack) -> Qwen2Model:
    cfg = Qwen2Config(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "eager"
    hf = Qwen2Model(cfg).eval()
    state = {k: v for k, v in ours.state_dict().items() if k in hf.state_dict()}
    missing = set(hf.state_dict()) - set(state) - {"embed_tokens.weight"}
    assert not missing, missing
    hf.load_state_dict(state, strict=False)
    return hf


def _cached(stack: Qwen2Stack, pieces: list[list[torch.Tensor]], max_len: int) -> list[torch.Tensor]:
    """Run rows through the slot cache: pieces[step][row] [t, H] (rows advance together, padded)."""
    cache = KVSlots(stack.shape, len(pieces[0]), max_len, dtype=torch.float32, device="cpu")
    done = [0] * len(pieces[0])
    outs: list[list[torch.Tensor]] = [[] for _ in pieces[0]]
    for step in pieces:
        width = max(p.shape[0] for p in step)
        x = torch.zeros(len(step), width, stack.shape.hidden_size)
        for i, p in enumerate(step):
            x[i, : p.shape[0]] = p
        rows = Rows.of(list(range(len(step))), list(done), [p.shape[0] for p in step], "cpu")
        h = stack(x, cache, rows)
        for i, p in enumerate(step):
            outs[i].append(h[i, : p.shape[0]])
            done[i] += p.shape[0]
    return [torch.cat(o) for o in outs]


def test_lm_matches_transformers_qwen2(talker_ckpt, talker_models):
    config = json.loads((talker_ckpt / "talker/llm/config.json").read_text())
    ours = talker_models.talker.model
    hf = _hf_qwen2(config, ours)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randn(n, config["hidden_size"], generator=gen) for n in (13, 9)]
    with torch.no_grad():
        want = [hf(inputs_embeds=s[None]).last_hidden_state[0] for s in seqs]
        whole = ours(seqs[0][None])[0]
        # prefill of different lengths, then three decode steps of both rows in one batch
        got = _cached(
            ours,
            [
                [seqs[0][:10], seqs[1][:6]],
                *[[s[i : i + 1] for s in (seqs[0][10:], seqs[1][6:])] for i in range(3)],
            ],
            32,
        )
    torch.testing.assert_close(whole, want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=1e-4)


def test_vae_decoder_backbone_matches_transformers_with_its_sliding_window(talker_ckpt, talker_models):
    config = json.loads((talker_ckpt / "talker/vae/config.json").read_text())["dec_kwargs"]["backbone"]
    ours = talker_models.vae.decoder.decoder
    assert ours.shape.windows == (0, 24)  # layer 1 sees 24 frames: the test runs past the window
    hf = _hf_qwen2(config, ours)
    x = torch.randn(70, config["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(inputs_embeds=x[None]).last_hidden_state[0]
        whole = ours(x[None])[0]
        chunks = [x[i : i + 16] for i in range(0, 70, 16)]
        got = _cached(ours, [[c] for c in chunks], 80)[0]
    torch.testing.assert_close(whole, want, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_istft_head_matches_torch_istft(talker_models):
    head = talker_models.vae.decoder.head
    hidden = torch.randn(12, head.out.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = head.decode_whole(hidden)
        pred = head.out(hidden).float()
        n_fft, hop = head.istft.n_fft, head.istft.hop
        log_mag, phase = pred.chunk(2, dim=-1)
        spec = torch.exp(log_mag).clamp(max=100) * torch.exp(1j * phase)
        ref = torch.istft(spec.T, n_fft, hop, n_fft, torch.hann_window(n_fft), center=True)
    assert ours.shape == (12 * hop,)
    # "same" padding trims (n_fft - hop) / 2 per side, torch's center mode n_fft / 2: offset hop / 2.
    offset = n_fft // 2 - (n_fft - hop) // 2
    torch.testing.assert_close(ours[offset : offset + ref.shape[0]], ref, atol=1e-6, rtol=1e-4)


def _velocity(dit, y, tau, cond, history):
    """The DiT velocity written plainly: one forward per condition, the timestep sinusoid by hand."""
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / (half - 1))
    args = 1000 * tau * freqs
    t_emb = dit.t_embedder.time_mlp(torch.cat((args.sin(), args.cos()))[None])
    seq = torch.cat(
        (
            t_emb[:, None] + dit.c_embedder.cond_embedder(cond)[:, None],
            dit.x_embedder(history),
            dit.x_embedder(y),
        ),
        dim=1,
    )
    cos, sin = dit.rotary_embed.cos_sin(seq.shape[1])
    return dit.final_layer(dit.run_blocks(seq, cos, sin))[:, -y.shape[1] :]


def test_cfm_sample_follows_the_euler_cfg_sway_update(talker_models):
    dit = talker_models.talker.dit
    gen = torch.Generator().manual_seed(3)
    cond = torch.randn(2, talker_models.config.llm.hidden_size, generator=gen)
    history = torch.randn(2, 32, 64, generator=gen)
    noise = torch.randn(2, 4, 64, generator=gen)
    from omnistage.services.talker.models.dit import sway_times

    with torch.no_grad():
        plan = dit.plan(sway_times(10), history.shape[1], noise.shape[1], cond.device)
        got = dit.sample_planned(plan, cond, history, noise, cfg_strength=2.0)
        grid = torch.tensor([0, 2, 4, 6, 8, 12, 16, 20, 24, 28, 32]) / 32
        times = 1 - torch.cos(math.pi / 2 * grid)
        y = noise.clone()
        for k in range(10):
            v_c = _velocity(dit, y, times[k], cond, history)
            v_0 = _velocity(dit, y, times[k], torch.zeros_like(cond), history)
            y = y + (v_c + 2.0 * (v_c - v_0)) * (times[k + 1] - times[k])
    torch.testing.assert_close(got, y, atol=1e-5, rtol=1e-4)


def test_aggregator_is_the_cls_row_of_its_blocks(talker_models):
    agg = talker_models.talker.aggregator
    z = torch.randn(3, 4, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        seq = torch.cat((agg.word_embedder.weight[None].expand(3, 1, -1), agg.x_embedder(z)), dim=1)
        cos, sin = agg.rotary_embed.cos_sin(5)
        for block in agg.blocks:
            seq = block(seq, cos, sin)
        want = agg.final_layer(seq)[:, 0]
        torch.testing.assert_close(agg(z), want)


@pytest.mark.parametrize("pairs", [(1, 3), (2, 5)])
def test_interleaved_rotary_rotates_pairs(talker_models, pairs):
    from omnistage.services.talker.models.dit import apply_interleaved_rotary

    rot = talker_models.talker.dit.rotary_embed
    cos, sin = rot.cos_sin(8)
    x = torch.randn(8, rot.head_dim, generator=torch.Generator().manual_seed(5))
    out = apply_interleaved_rotary(x, cos, sin)
    i, pos = pairs
    angle = pos * rot.inv_freq[i]
    a, b = x[pos, 2 * i], x[pos, 2 * i + 1]
    torch.testing.assert_close(out[pos, 2 * i], a * torch.cos(angle) - b * torch.sin(angle))
    torch.testing.assert_close(out[pos, 2 * i + 1], b * torch.cos(angle) + a * torch.sin(angle))
    assert F.mse_loss(out.norm(dim=-1), x.norm(dim=-1)) < 1e-10  # a rotation keeps lengths
