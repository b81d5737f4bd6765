"""Our KL VAE equals diffusers' `AutoencoderKL` on the same weights: decode (every image) and encode's
posterior mode (edits), with the pipeline's scaling/shift, with and without the 1x1 quant convs."""

from __future__ import annotations

import pytest
import torch
from diffusers import AutoencoderKL as DiffusersVAE
from omnistage.common.checkpoint.tiny_imagegen import TINY_VAE
from omnistage.services.imagegen.models.config import VaeConfig
from omnistage.services.imagegen.models.vae import AutoencoderKL


def seeded(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("quant_conv", [False, True])
def test_decode_and_encode_equal_diffusers(quant_conv):
    torch.manual_seed(0)
    settings = {**TINY_VAE, "use_quant_conv": quant_conv, "use_post_quant_conv": quant_conv}
    ref = DiffusersVAE(**settings).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, 0.1)
    cfg = VaeConfig(
        **{
            k: tuple(v) if isinstance(v, list) else v
            for k, v in settings.items()
            if k not in ("sample_size", "force_upcast")
        }
    )
    ours = AutoencoderKL(cfg).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    scale, shift = TINY_VAE["scaling_factor"], TINY_VAE["shift_factor"]
    latents = seeded(1, 16, 6, 10, seed=1)
    image = seeded(1, 3, 48, 80, seed=2).tanh()
    with torch.no_grad():
        want_img = ref.decode(latents / scale + shift).sample
        want_lat = (ref.encode(image).latent_dist.mode() - shift) * scale
        got_img, got_lat = ours.decode(latents), ours.encode(image)
    assert got_img.shape == (1, 3, 48, 80) and got_lat.shape == (1, 16, 6, 10)
    assert torch.allclose(got_img, want_img, atol=1e-5), (got_img - want_img).abs().max()
    assert torch.allclose(got_lat, want_lat, atol=1e-5), (got_lat - want_lat).abs().max()
    assert want_img.abs().max() > 1e-2 and want_lat.abs().max() > 1e-2
