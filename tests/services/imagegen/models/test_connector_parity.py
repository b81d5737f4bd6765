"""The connector equals transformers' Qwen2 run as the reference runs it (ming.md §6.1 step 4): causal
flag off on every layer, a 4-D all-ones float mask, `hidden_states[-1]`. Then the conditioning
formula: proj_in → connector → proj_out → L2 norm; the DiT wrapper's ×1000 L2 norm and its MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omnistage.common.checkpoint.tiny_imagegen import TINY_CONNECTOR
from omnistage.services.imagegen.models.config import ConnectorConfig, MlpConfig
from omnistage.services.imagegen.models.connector import ConditionEncoder, Qwen2Encoder
from transformers import Qwen2Config, Qwen2ForCausalLM


def seeded(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _reference() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    ref = Qwen2ForCausalLM(
        Qwen2Config(
            **TINY_CONNECTOR,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
            attn_implementation="sdpa",
        )
    ).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.normal_(1.0, 0.05) if "norm" in name else p.normal_(0.0, 0.1)
    return ref


def test_bidirectional_connector_equals_transformers():
    ref = _reference()
    ours = Qwen2Encoder(ConnectorConfig(**TINY_CONNECTOR)).eval()
    state = {k: v for k, v in ref.state_dict().items() if not k.startswith(("model.embed_tokens", "lm_head"))}
    ours.load_state_dict(state, strict=True)
    x = seeded(2, 256, TINY_CONNECTOR["hidden_size"], seed=1)
    for layer in ref.model.layers:
        layer.self_attn.is_causal = False
    with torch.no_grad():
        want = ref(
            inputs_embeds=x, attention_mask=torch.ones(2, 1, 256, 256), output_hidden_states=True
        ).hidden_states[-1]
        got = ours(x)
        for layer in ref.model.layers:
            layer.self_attn.is_causal = True
        causal = ref(inputs_embeds=x, output_hidden_states=True).hidden_states[-1]
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert (got - causal).abs().max() > 1e-2  # a causal connector would differ: the test can fail


def _encoder(identity: bool) -> ConditionEncoder:
    mlp = MlpConfig(diffusion_c_input_dim=40, use_identity_mlp=identity)
    enc = ConditionEncoder(mlp, ConnectorConfig(**TINY_CONNECTOR), thinker_hidden=32, cap_feat_dim=48).eval()
    with torch.no_grad():
        for p in enc.parameters():
            p.normal_(0.0, 0.2)
    return enc


def test_condition_and_caption_formula():
    enc = _encoder(identity=True)
    h = seeded(1, 256, 32, seed=2)
    with torch.no_grad():
        cond = enc.condition(h)
        cap = enc.caption(cond)
        want = F.normalize(enc.proj_out(enc.connector(enc.proj_in(h))), dim=-1)
        negative = enc.caption(torch.zeros_like(cond))
    assert torch.allclose(cond, want, atol=1e-6)
    assert torch.allclose(cap.norm(dim=-1), torch.full((1, 256), 1000.0), rtol=1e-5)
    assert torch.equal(negative, torch.zeros_like(cond))  # zero conditioning stays zero through the wrapper


def test_non_identity_wrapper_mlp():
    """`use_identity_mlp: false` (not the release's, which is inferred): LN(fc2(relu(LN(fc1(x))))) after ×1000."""
    enc = _encoder(identity=False)
    cond = F.normalize(seeded(1, 4, 40, seed=3), dim=-1)
    m = enc.mlp
    with torch.no_grad():
        x = cond * 1000.0
        want = m.layer_norm2(m.fc2(torch.relu(m.layer_norm1(m.fc1(x)))))
        got = enc.caption(cond)
        negative = enc.caption(torch.zeros_like(cond))
    assert got.shape == (1, 4, 48) and torch.allclose(got, want, atol=1e-5)
    assert torch.allclose(negative, m(torch.zeros_like(cond)))  # the negative row is the MLP of zeros
