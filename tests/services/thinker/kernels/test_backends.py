"""The kernel seam: what `auto` picks, what cannot run where, what the deploy file accepts, and
that installing a backend reaches every layer (and `torch` takes it all back)."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import ConfigError, config_from_dict
from omnistage.services.thinker.models.layers.attention import TORCH_ATTENTION
from omnistage.services.thinker.models.layers.backends import (
    BackendError,
    Backends,
    TritonAttention,
    install_backends,
    resolve_backends,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_is_the_reference_on_a_cpu_and_triton_on_cuda(monkeypatch):
    assert resolve_backends("auto", "auto", CPU, 16, 128) == Backends("torch", "torch")
    assert resolve_backends("auto", "auto", CUDA, 16, 128) == Backends("triton", "triton")
    assert resolve_backends("auto", "auto", CUDA, 16, 128).graph_safe
    # Shapes the paged kernels cannot take keep attention on the reference (experts still fused).
    assert resolve_backends("auto", "auto", CUDA, 8, 128) == Backends("torch", "triton")
    assert not resolve_backends("auto", "auto", CUDA, 8, 128).graph_safe


def test_an_explicit_backend_that_cannot_run_here_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendError, match="attention_backend triton needs a CUDA device"):
        resolve_backends("triton", "torch", CPU, 16, 128)
    with pytest.raises(BackendError, match="block_size >= 16"):
        resolve_backends("triton", "torch", CUDA, 8, 128)
    with pytest.raises(BackendError, match="expected one of"):
        resolve_backends("flash", "torch", CUDA, 16, 128)


@pytest.mark.parametrize("key", ["attention_backend", "moe_backend"])
def test_the_deploy_file_names_the_allowed_backends(key):
    data = {"services": {"thinker": {"kind": "thinker", "port": 7161, "engine": {key: "cuda"}}}}
    with pytest.raises(
        ConfigError, match=f"services.thinker.engine.{key}: expected one of auto, torch, triton"
    ):
        config_from_dict(data)


def test_installing_reaches_every_layer_and_torch_restores_the_reference(tiny_ckpt):
    from omnistage.services.thinker.models.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32, device="cpu")
    install_backends(model, Backends("triton", "triton"))
    layers = model.model.layers
    assert all(isinstance(a, TritonAttention) for a in [layer.attention.attn.backend for layer in layers])
    assert all(layer.input_layernorm.kernel is not None for layer in layers)
    moe = [layer.mlp for layer in layers if hasattr(layer.mlp, "experts")]
    assert moe and all(m.experts.kernel is not None and m.gate.kernel is not None for m in moe)
    install_backends(model, Backends("torch", "torch"))
    assert all(layer.attention.attn.backend is TORCH_ATTENTION for layer in layers)
    assert all(m.experts.kernel is None and m.gate.kernel is None and m.gate.norm_kernel is None for m in moe)
    assert model.model.norm.kernel is None


def test_the_fusions_switch_reaches_the_moe_kernels_and_refuses_a_typo(tiny_ckpt, monkeypatch):
    from omnistage.services.thinker.kernels import router
    from omnistage.services.thinker.models.layers.backends import FUSIONS_ENV
    from omnistage.services.thinker.models.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32, device="cpu")
    moe = [layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts")]
    for value, fused in (("off", False), (" ON ", True)):
        monkeypatch.setenv(FUSIONS_ENV, value)
        install_backends(model, Backends("triton", "triton"))
        assert all(m.gate.kernel.keywords == {"fuse": fused} for m in moe)
        assert all(m.experts.kernel.keywords == {"fuse": fused} for m in moe)
        # the post-attention add + norm in the router's launch (kernels/router.py): fusions on only
        assert all(m.gate.norm_kernel is (router.normed_route if fused else None) for m in moe)
    install_backends(model, Backends("torch", "triton"))  # the norm's reference: it runs first
    assert all(m.gate.kernel is not None and m.gate.norm_kernel is None for m in moe)
    monkeypatch.setenv(FUSIONS_ENV, "of")
    with pytest.raises(BackendError, match=f"{FUSIONS_ENV}='of': expected on or off"):
        install_backends(model, Backends("triton", "triton"))


def test_decode_tiles_come_from_the_environment_and_a_bad_value_is_refused_naming_it(monkeypatch):
    """OMNISTAGE_THINKER_DECODE_TILES=P,W sets the decode attention's tiles read before its wait and its
    warps (a same-build comparison); unset, the kernel's default; a malformed or out-of-range value is
    refused at install, naming the variable."""
    from omnistage.services.thinker.kernels.paged_attention import DecodeTiles
    from omnistage.services.thinker.models.layers.backends import DECODE_TILES_ENV, TritonAttention

    monkeypatch.delenv(DECODE_TILES_ENV, raising=False)
    assert TritonAttention().decode_tiles is None
    monkeypatch.setenv(DECODE_TILES_ENV, " 2,8 ")
    assert TritonAttention().decode_tiles == DecodeTiles(preload_tiles=2, warps=8)
    monkeypatch.setenv(DECODE_TILES_ENV, "2,4,256")
    assert TritonAttention().decode_tiles == DecodeTiles(preload_tiles=2, warps=4, min_chunk=256)
    for bad in ("2", "two,4", "9,4", "1,3", "1,4,100", "1,4,128,2"):
        monkeypatch.setenv(DECODE_TILES_ENV, bad)
        with pytest.raises(BackendError, match=DECODE_TILES_ENV):
            TritonAttention()
