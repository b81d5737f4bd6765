"""Streaming AudioVAE decode: chunked == whole, batched streams == each alone, the upsampler == interpolate."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from omnistage.services.talker.models.audio_vae import DecodeStream, UpsampleState, upsample_frames


@pytest.mark.parametrize("chunks", [(4, 4, 4, 4, 4), (1, 3, 4, 2, 7, 1), (17,)])
def test_upsampler_in_chunks_equals_interpolate(chunks):
    feats = torch.randn(sum(chunks), 8, generator=torch.Generator().manual_seed(0))
    want = F.interpolate(feats.T[None], scale_factor=4, mode="linear", align_corners=False)[0].T
    state, got, offset = UpsampleState(), [], 0
    for i, n in enumerate(chunks):
        got.append(upsample_frames(feats[offset : offset + n], state, 4, last=i == len(chunks) - 1))
        offset += n
    got = torch.cat(got)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want)


def test_upsampler_emits_a_frame_as_soon_as_its_latents_exist():
    state = UpsampleState()
    first = upsample_frames(torch.randn(4, 8), state, 4, last=False)
    assert first.shape[0] == 14  # the last latent's right half waits for the next latent
    assert upsample_frames(torch.randn(4, 8), state, 4, last=False).shape[0] == 16
    assert upsample_frames(torch.randn(0, 8), state, 4, last=True).shape[0] == 2


def _stream(decoder, cache, slot, latents, chunks):
    stream, out, offset = DecodeStream(slot), [], 0
    for i, n in enumerate(chunks):
        out.append(
            decoder.decode_step([stream], [latents[offset : offset + n]], [i == len(chunks) - 1], cache)[0]
        )
        offset += n
    return torch.cat(out)


def test_streamed_decode_equals_whole_decode(talker_models):
    decoder = talker_models.vae.decoder
    latents = torch.randn(26, 64, generator=torch.Generator().manual_seed(1))  # 104 frames, past the window
    cache = decoder.new_cache(2, 128, dtype=torch.float32, device="cpu")
    whole = decoder.decode_whole(latents)
    streamed = _stream(decoder, cache, 0, latents, (4, 4, 4, 4, 4, 4, 2))
    assert whole.shape == streamed.shape == (26 * talker_models.config.vae.samples_per_latent,)
    assert whole.abs().mean() > 1e-3  # audible: the comparison is not between two silences
    torch.testing.assert_close(streamed, whole, atol=1e-5, rtol=1e-4)
    assert torch.allclose(_stream(decoder, cache, 1, latents, (1, 9, 16)), whole, atol=1e-5, rtol=1e-4)


def test_batched_streams_equal_each_alone(talker_models):
    decoder = talker_models.vae.decoder
    gen = torch.Generator().manual_seed(2)
    a, b = torch.randn(12, 64, generator=gen), torch.randn(8, 64, generator=gen)
    cache = decoder.new_cache(3, 64, dtype=torch.float32, device="cpu")
    alone_a, alone_b = decoder.decode_whole(a), decoder.decode_whole(b)
    sa, sb = DecodeStream(0), DecodeStream(2)
    outs_a, outs_b = [], []
    # b starts one step later and ends first: rows at different positions share every forward
    out = decoder.decode_step([sa], [a[:4]], [False], cache)
    outs_a.append(out[0])
    for i in range(2):
        out = decoder.decode_step(
            [sa, sb], [a[4 + 4 * i : 8 + 4 * i], b[4 * i : 4 + 4 * i]], [i == 1, i == 1], cache
        )
        outs_a.append(out[0])
        outs_b.append(out[1])
    torch.testing.assert_close(torch.cat(outs_a), alone_a, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(outs_b), alone_b, atol=1e-5, rtol=1e-4)
