"""ImagePipeline against the reference pipeline's loop, composed from diffusers' and transformers'
classes on the tiny checkpoint's own files (ming.md §6: connector run bidirectionally, ×1000 norm,
zero negative, CFG only when guidance > 1, negated velocity into the flow-match Euler scheduler with
sigma_min 0 and mu from the image size, fp32 latents, `ref_x` as a second frame, VAE decode and
diffusers' rounding); seeded generation reproducible; a request batched with others gets its alone result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
from omnistage.common.checkpoint.shards import iter_tensors
from omnistage.services.imagegen import images
from omnistage.services.imagegen.pipeline import GenerationSpec, ImagePipeline
from transformers import Qwen2ForCausalLM

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
BUCKET = (128, 192)  # any multiple of 16 works for the pipeline; the service uses the table


def _hidden(seed: int) -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(seed))


def _reference_rgb(seed: int = 9) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*BUCKET, 3), dtype=np.uint8)


class ReferenceLoop:
    """The reference generation (ZImageLoss.sample → ZImagePipeline.__call__) on diffusers/transformers modules."""

    def __init__(self, root) -> None:
        f32 = torch.float32
        self.connector = Qwen2ForCausalLM.from_pretrained(root / "connector", torch_dtype=f32).eval()
        for layer in self.connector.model.layers:
            layer.self_attn.is_causal = False
        mlp = {k: v.float() for k, v in iter_tensors(root / "mlp" / "model.safetensors")}
        self.proj_in = torch.nn.Linear(*mlp["proj_in.weight"].shape[::-1])
        self.proj_in.load_state_dict({"weight": mlp["proj_in.weight"], "bias": mlp["proj_in.bias"]})
        self.proj_out = torch.nn.Linear(*mlp["proj_out.weight"].shape[::-1])
        self.proj_out.load_state_dict({"weight": mlp["proj_out.weight"], "bias": mlp["proj_out.bias"]})
        self.dit = ZImageTransformer2DModel.from_pretrained(
            root, subfolder="transformer", torch_dtype=f32
        ).eval()
        self.vae = AutoencoderKL.from_pretrained(root, subfolder="vae", torch_dtype=f32).eval()
        self.root = root

    @torch.no_grad()
    def generate(self, hidden: torch.Tensor, steps: int, guidance: float, seed: int, rgb: np.ndarray | None):
        e = self.proj_in(hidden[None])
        e = self.connector(
            inputs_embeds=e, attention_mask=torch.ones(1, 1, 256, 256), output_hidden_states=True
        )
        cond = F.normalize(self.proj_out(e.hidden_states[-1]), dim=-1)
        wrap = lambda c: F.normalize(c, dim=-1) * 1000.0  # noqa: E731 - text_encoder_norm, identity MLP
        pos_cap, neg_cap = wrap(cond)[0], wrap(cond * 0.0)[0]
        h, w = BUCKET[0] // 8, BUCKET[1] // 8
        latents = torch.randn((1, 16, h, w), generator=torch.manual_seed(seed), dtype=torch.float32)
        ref = None
        if rgb is not None:
            cfg = self.vae.config
            ref = (
                self.vae.encode(images.reference_tensor(rgb)).latent_dist.mode() - cfg.shift_factor
            ) * cfg.scaling_factor
        sched = FlowMatchEulerDiscreteScheduler.from_pretrained(self.root, subfolder="scheduler")
        sched.config["use_dynamic_shifting"] = True
        sched.sigma_min = 0.0
        c = sched.config  # the pipeline's calculate_shift, on the scheduler's own config
        m = (c.get("max_shift", 1.15) - c.get("base_shift", 0.5)) / (
            c.get("max_image_seq_len", 4096) - c.get("base_image_seq_len", 256)
        )
        mu = (h // 2) * (w // 2) * m + c.get("base_shift", 0.5) - m * c.get("base_image_seq_len", 256)
        sched.set_timesteps(steps, mu=mu)
        cfg_on = guidance > 1
        for t in sched.timesteps:
            timestep = (1000 - t.expand(1)) / 1000
            rows = 2 if cfg_on else 1
            x = latents.repeat(rows, 1, 1, 1).unsqueeze(2)
            if ref is not None:
                x = torch.cat([x, ref.repeat(rows, 1, 1, 1).unsqueeze(2)], dim=2)
            caps = [pos_cap, neg_cap] if cfg_on else [pos_cap]
            out = self.dit(list(x.unbind(0)), timestep.repeat(rows), caps, return_dict=False)[0]
            pos = out[0][:, :1].float()
            pred = pos + guidance * (pos - out[1][:, :1].float()) if cfg_on else pos
            latents = sched.step(-pred.squeeze(1)[None], t, latents, return_dict=False)[0]
        cfg = self.vae.config
        image = self.vae.decode(latents / cfg.scaling_factor + cfg.shift_factor).sample
        image = (image * 0.5 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).float().numpy()
        return latents, (image[0] * 255).round().astype("uint8")


@pytest.fixture(scope="module")
def reference(tiny_ckpt) -> ReferenceLoop:
    return ReferenceLoop(tiny_ckpt)


def _run(pipeline: ImagePipeline, spec: GenerationSpec):
    state = pipeline.prepare(spec)
    while not state.done:
        pipeline.step([state])
    return state, pipeline.decode(state)


@pytest.mark.parametrize(("guidance", "edit"), [(2.0, False), (1.0, False), (3.5, True)])
def test_generation_equals_the_reference_loop(pipeline, reference, guidance, edit):
    rgb = _reference_rgb() if edit else None
    spec = GenerationSpec(_hidden(1), BUCKET, 4, guidance, 1234, rgb)
    state, pixels = _run(pipeline, spec)
    want_latents, want_pixels = reference.generate(_hidden(1), 4, guidance, 1234, rgb)
    assert torch.allclose(state.latents, want_latents, atol=1e-4), (state.latents - want_latents).abs().max()
    diff = np.abs(pixels.numpy().astype(int) - want_pixels.astype(int))
    assert pixels.shape == (*BUCKET, 3) and diff.max() <= 1 and (diff > 0).mean() < 0.01
    assert state.forwards == 3  # the 4th step (sigma 0 → 0) moves nothing: no forward


def test_seeded_generation_is_reproducible(pipeline):
    a = _run(pipeline, GenerationSpec(_hidden(2), BUCKET, 3, 2.0, 7))[1]
    b = _run(pipeline, GenerationSpec(_hidden(2), BUCKET, 3, 2.0, 7))[1]
    c = _run(pipeline, GenerationSpec(_hidden(2), BUCKET, 3, 2.0, 8))[1]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_batched_equals_alone(pipeline):
    """Requests of one shape in one forward — with and without guidance, joining at different steps — each
    end with the latents they get alone."""
    specs = [
        GenerationSpec(_hidden(3), BUCKET, 5, 2.0, 1),
        GenerationSpec(_hidden(4), BUCKET, 5, 1.0, 2),
        GenerationSpec(_hidden(5), BUCKET, 3, 4.0, 3),
    ]
    alone = [_run(pipeline, s)[0].latents for s in specs]
    first, second = pipeline.prepare(specs[0]), pipeline.prepare(specs[1])
    pipeline.step([first, second])
    third = pipeline.prepare(specs[2])  # joins at a step boundary, two steps behind
    while not (first.done and second.done and third.done):
        pipeline.step([s for s in (first, second, third) if not s.done])
    for state, want in zip((first, second, third), alone, strict=True):
        assert torch.allclose(state.latents, want, atol=1e-5), (state.latents - want).abs().max()
    assert not torch.allclose(first.latents, second.latents)


def test_states_of_different_shapes_do_not_share_a_forward(pipeline):
    a = pipeline.prepare(GenerationSpec(_hidden(6), BUCKET, 2, 2.0, 1))
    b = pipeline.prepare(GenerationSpec(_hidden(6), (128, 128), 2, 2.0, 1))
    with pytest.raises(ValueError, match="different shapes"):
        pipeline.step([a, b])
