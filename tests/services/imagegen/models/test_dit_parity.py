"""Our Z-Image DiT equals diffusers' `ZImageTransformer2DModel` on the same weights (ming.md §6.2).

Covers caption and image padding to multiples of 32 (pad tokens, pad position ids), rows with
different timesteps in one batch, and the edit path's second latent frame (the Ming `ref_x`
concatenation along frames, which diffusers takes as F = 2).
"""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImageTransformer2DModel
from omnistage.common.checkpoint.tiny_imagegen import TINY_DIT
from omnistage.services.imagegen.models.config import DiTConfig
from omnistage.services.imagegen.models.dit import ZImageDiT


def seeded(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.fixture(scope="module")
def pair() -> tuple[ZImageTransformer2DModel, ZImageDiT]:
    return make_pair()


def make_pair(**shape) -> tuple[ZImageTransformer2DModel, ZImageDiT]:
    """diffusers' tiny model (TINY_DIT, with `shape`'s keys changed) with non-trivial weights, and ours
    holding the same."""
    torch.manual_seed(0)
    shape = {**TINY_DIT, **shape}
    ref = ZImageTransformer2DModel(**shape).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():  # non-trivial norms and pad tokens, larger than the init
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.08)
    ours = ZImageDiT(
        DiTConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in shape.items()})
    ).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)  # the same parameter names
    return ref, ours


@pytest.mark.parametrize(
    ("frames", "h", "w", "cap_len"), [(1, 24, 40, 37), (1, 16, 16, 256), (2, 16, 24, 64)]
)
def test_forward_equals_diffusers(pair, frames, h, w, cap_len):
    ref, ours = pair
    x = seeded(2, 16, frames, h, w, seed=1)
    t = torch.tensor([0.05, 0.7])
    cap = seeded(2, cap_len, TINY_DIT["cap_feat_dim"], seed=2, scale=3.0)
    with torch.no_grad():
        want = torch.stack(ref(list(x.unbind(0)), t, list(cap.unbind(0)), return_dict=False)[0])
        got = ours(x, t, cap)
    assert got.shape == want.shape == x.shape
    assert torch.allclose(got, want, atol=2e-5, rtol=1e-5), (got - want).abs().max()
    # Each row is its own: the batch of two equals each row alone.
    with torch.no_grad():
        alone = ours(x[1:], t[1:], cap[1:])
    assert torch.allclose(alone, got[1:], atol=1e-5)


def test_padding_and_time_change_the_output(pair):
    """The test above is not vacuous: timestep and caption reach the output."""
    _, ours = pair
    x = seeded(1, 16, 1, 16, 16, seed=3)
    cap = seeded(1, 37, TINY_DIT["cap_feat_dim"], seed=4)
    with torch.no_grad():
        a = ours(x, torch.tensor([0.1]), cap)
        b = ours(x, torch.tensor([0.9]), cap)
        c = ours(x, torch.tensor([0.1]), cap.flip(1))
    assert (a - b).abs().max() > 1e-3 and (a - c).abs().max() > 1e-3
