"""The DiT's fused Triton kernels equal the torch reference, run on the CPU by Triton's interpreter in fp32
(TRITON_INTERPRET=1; speed and bf16 are the GPU run's `bench/speech_image_gpu.sh`): norm + modulation,
norm + gate + residual (with and without modulation), QK-norm + rope with batch-shared and per-row
tables, at widths that are not powers of two (masked lanes); and the whole DiT with the kernels forced
equals diffusers' model, while "auto" keeps the torch path off CUDA; and the kernels compile for sm_90
in bf16 (no GPU needed). Skipped only where Triton cannot import."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from omnistage.services.imagegen.models import fused

pytest.importorskip("triton", reason="Triton is not installed (pip install '.[dev]')")
if os.environ.get("TRITON_INTERPRET") != "1":  # tests/conftest.py turns it on where no NVIDIA driver is
    pytest.skip(
        "CPU tensors need Triton's interpreter (TRITON_INTERPRET=1 before torch is imported)",
        allow_module_level=True,
    )


def rand(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("d", [96, 128])
@pytest.mark.parametrize("modulated", [True, False])
def test_norm_modulate_and_gate_residual_equal_the_torch_block_maths(d, modulated):
    x, h, res = rand(2, 7, d, seed=1, scale=3.0), rand(2, 7, d, seed=2), rand(2, 7, d, seed=3)
    w = 1 + rand(d, seed=4, scale=0.1)
    scale = rand(2, 1, d, seed=5) if modulated else None
    gate = rand(2, 1, d, seed=6, scale=2.0) if modulated else None
    torch.testing.assert_close(
        fused.norm_modulate(x, w, 1e-5, scale),
        fused.norm_modulate_ref(x, w, 1e-5, scale),
        atol=1e-5,
        rtol=1e-5,
    )
    torch.testing.assert_close(
        fused.norm_gate_residual(res, h, w, 1e-5, gate),
        fused.norm_gate_residual_ref(res, h, w, 1e-5, gate),
        atol=1e-5,
        rtol=1e-5,
    )


def test_the_kernels_read_the_modulation_of_each_rows_own_batch_entry():
    x, w = rand(2, 3, 96, seed=1), torch.ones(96)
    scale = torch.stack([torch.zeros(1, 96), torch.ones(1, 96)])  # batch 1 doubles
    out = fused.norm_modulate(x, w, 1e-5, scale)
    torch.testing.assert_close(out[1], 2 * fused.norm_modulate_ref(x, w, 1e-5, None)[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0], fused.norm_modulate_ref(x, w, 1e-5, None)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shared_table", [True, False])
def test_qk_norm_rope_equals_norm_then_rotary(shared_table):
    q, k = rand(2, 5, 3, 48, seed=1, scale=2.0), rand(2, 5, 3, 48, seed=2)
    wq, wk = 1 + rand(48, seed=3, scale=0.1), 1 + rand(48, seed=4, scale=0.1)
    angles = rand(5, 24, seed=5, scale=3.0) if shared_table else rand(2, 5, 24, seed=5, scale=3.0)
    cos, sin = angles.cos(), angles.sin()
    if shared_table:  # the DiT's tables: one [N, D/2] expanded over the batch
        cos, sin = cos.expand(2, -1, -1), sin.expand(2, -1, -1)
    got = fused.qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin)
    want = fused.qk_norm_rope(q, k, wq, wk, 1e-5, cos, sin, ref=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_the_dit_with_its_kernels_forced_equals_diffusers(monkeypatch):
    """One main layer (the tiny checkpoint has two): each kind of block (the modulated noise refiner, the
    unmodulated caption refiner, a main layer) still runs every kernel, and the interpreter runs each
    kernel program in Python (one per row: a layer is a third of the test's CPU)."""
    from tests.services.imagegen.models.test_dit_parity import make_pair, seeded

    ref, ours = make_pair(n_layers=1)
    x, t = (
        seeded(1, 16, 1, 8, 8, seed=1),
        torch.tensor([0.3]),
    )  # small: the interpreter runs each program in Python
    cap = seeded(1, 5, ours.cfg.cap_feat_dim, seed=2, scale=3.0)
    calls = []
    real = fused.qk_norm_rope
    monkeypatch.setattr(fused, "qk_norm_rope", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        want = torch.stack(ref(list(x.unbind(0)), t, list(cap.unbind(0)), return_dict=False)[0])
        assert not ours.fused_for(x)  # "auto" on the CPU: the torch path
        ours(x, t, cap)
        assert not calls
        ours.kernels = "triton"
        got = ours(x, t, cap)
    n_blocks = ours.cfg.n_layers + 2 * ours.cfg.n_refiner_layers
    assert len(calls) == n_blocks
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from omnistage.services.imagegen.models import fused_kernels as fk

bf16 = "*bf16"
row = {"tokens": "i32", "D": "i32", "eps": "fp32"}
cases = [
    (fk.norm_modulate_kernel, {"x_ptr": bf16, "w_ptr": bf16, "scale_ptr": bf16, "out_ptr": bf16, **row},
     {"HAS_SCALE": True, "BLOCK": 4096}),
    (fk.norm_gate_residual_kernel, {"res_ptr": bf16, "h_ptr": bf16, "w_ptr": bf16, "gate_ptr": bf16,
                                    "out_ptr": bf16, **row}, {"HAS_GATE": True, "BLOCK": 4096}),
    (fk.qk_norm_rope_kernel, {"q_ptr": bf16, "k_ptr": bf16, "wq_ptr": bf16, "wk_ptr": bf16, "cos_ptr": "*fp32",
                              "sin_ptr": "*fp32", "qo_ptr": bf16, "ko_ptr": bf16, "heads": "i32", "cos_rows": "i32",
                              "HALF": "i32", "eps": "fp32"}, {"BLOCK": 64}),
]
for fn, sig, consts in cases:
    sig = {**sig, **{k: "constexpr" for k in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    print(fn.__name__, "cubin" in triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm)
"""


def test_the_kernels_compile_for_sm90_in_bf16(tmp_path):
    """What the interpreter does not check — Triton's type rules and lowering — for the H100/H200 target,
    ahead of any GPU (a fresh process: the interpreter must be off when the kernels are decorated)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.split() == [
        "norm_modulate_kernel",
        "True",
        "norm_gate_residual_kernel",
        "True",
        "qk_norm_rope_kernel",
        "True",
    ]
