"""Fused DiT kernels (Triton) for the block's norms, modulation, gates and QK-norm + rope (issue 21)."""

from __future__ import annotations

import functools
import importlib.util
from types import ModuleType

import torch
from omnistage.services.imagegen.models.norms import diffusers_rms_norm as rms_norm_ref


def triton_ok() -> bool:
    """Triton is installed (the device image has it; CPU CI may not)."""
    return importlib.util.find_spec("triton") is not None


# -- the torch reference: the block's maths exactly as `Block` / `Attention` compute it ---------------


def norm_modulate_ref(
    x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None
) -> torch.Tensor:
    """RMSNorm(x)·w·(1 + scale); x [B, N, D], scale [B, 1, D] or None."""
    y = rms_norm_ref(x, w, eps)
    return y if scale is None else y * (1.0 + scale)


def norm_gate_residual_ref(
    res: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None
) -> torch.Tensor:
    """res + tanh(gate)·RMSNorm(h)·w; gate [B, 1, D] (before tanh) or None."""
    y = rms_norm_ref(h, w, eps)
    return res + (y if gate is None else gate.tanh() * y)


def rope_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive channel pairs in float32; x [B, N, heads, D], cos/sin [B, N, D/2]."""
    pairs = x.float().unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


# -- Triton ----------------------------------------------------------------------------------------


@functools.cache
def _kernels() -> ModuleType:
    from omnistage.services.imagegen.models import fused_kernels

    return fused_kernels


def _block(n: int) -> dict[str, int]:
    """Launch options of one program over n lanes: the power-of-two block and warps for its width."""
    block = _kernels().triton.next_power_of_2(n)
    return {"BLOCK": block, "num_warps": max(1, min(8, block // 256))}  # a head's 64 pairs: one warp


def _per_batch(t: torch.Tensor | None, b: int, d: int) -> torch.Tensor | None:
    """[B, 1, D] modulation → contiguous [B, D] (or None)."""
    return None if t is None else t.reshape(b, d).contiguous()


def norm_modulate(x: torch.Tensor, w: torch.Tensor, eps: float, scale: torch.Tensor | None) -> torch.Tensor:
    """`norm_modulate_ref` in one kernel; x [B, N, D] contiguous, result in w's dtype."""
    b, n, d = x.shape
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=w.dtype, device=x.device)
    s = _per_batch(scale, b, d)
    _kernels().norm_modulate_kernel[(b * n,)](
        x, w, s if s is not None else x, out, n, d, eps, HAS_SCALE=s is not None, **_block(d)
    )
    return out


def norm_gate_residual(
    res: torch.Tensor, h: torch.Tensor, w: torch.Tensor, eps: float, gate: torch.Tensor | None
) -> torch.Tensor:
    """`norm_gate_residual_ref` in one kernel; result in res's dtype."""
    b, n, d = h.shape
    res, h = res.contiguous(), h.contiguous()
    out = torch.empty_like(res)
    g = _per_batch(gate, b, d)
    _kernels().norm_gate_residual_kernel[(b * n,)](
        res, h, w, g if g is not None else h, out, n, d, eps, HAS_GATE=g is not None, **_block(d)
    )
    return out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    ref: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm(q)·wq and RMSNorm(k)·wk, each rotated by `rope_ref`'s rule, in one kernel; `ref`: the
    torch reference instead. q, k [B, N, heads, D], cos/sin [B, N, D/2] float32."""
    if ref:
        return rope_ref(rms_norm_ref(q, wq, eps), cos, sin), rope_ref(rms_norm_ref(k, wk, eps), cos, sin)
    b, n, heads, d = q.shape
    q, k = q.contiguous(), k.contiguous()
    if cos.stride(0) == 0:  # one table expanded over the batch: read it once per token position
        cos, sin = cos[0], sin[0]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    cos_rows = cos.numel() // (d // 2)
    qo, ko = (
        torch.empty(q.shape, dtype=wq.dtype, device=q.device),
        torch.empty(k.shape, dtype=wk.dtype, device=k.device),
    )
    _kernels().qk_norm_rope_kernel[(b * n * heads,)](
        q, k, wq, wk, cos, sin, qo, ko, heads, cos_rows, d // 2, eps, **_block(d // 2)
    )
    return qo, ko
