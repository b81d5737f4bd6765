"""Tensor-parallel linear layers; each weight carries a `weight_loader` that copies only this rank's slice.

Column-parallel layers split output rows (no communication), row-parallel layers split input
columns and all-reduce. `QKVParallelLinear` unpacks the checkpoint's [all Q; all K; all V] rows into
per-rank head blocks and replicates KV heads when there are fewer KV heads than ranks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from omnistage.services.thinker.models.layers.norm import RMSNorm
from omnistage.services.thinker.models.layers.parallel import TPGroup, divide
from torch import nn

# A small-batch matmul that replaces F.linear (x, weight) → x @ weightᵀ, set by `install_backends`
# (None: F.linear); it picks F.linear itself for the shapes it does not serve.
LinearKernel = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# The add + RMSNorm before a projection and the projection in one launch: (x, weight, norm weight,
# eps, residual or None) → (the projection of norm(x + residual), x + residual), or None where the
# kernel does not serve the shape (kernels/resident_gemv.py `normed_linear`; set by `install_backends`).
NormedLinearKernel = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]
# The same with the qkv projection's q and k heads QK-normed and roped in its launch: (x, weight, norm
# weight, eps, residual or None, ((q heads, KV heads, head dim), QKNormRope), whether the attention
# would apply it in a launch of its own) → as NormedLinearKernel, or None where it does not serve
# (kernels/resident_gemv.py `normed_qkv_rope`; set by `install_backends`).
NormedRopeKernel = Callable[..., tuple[torch.Tensor, torch.Tensor] | None]


def project(x: torch.Tensor, weight: torch.Tensor, kernel: LinearKernel | None) -> torch.Tensor:
    """x @ weightᵀ through `kernel` when one is installed, else F.linear."""
    return F.linear(x, weight) if kernel is None else kernel(x, weight)


def check_shape(param_name: str, got: torch.Size, want: tuple[int, ...] | torch.Size) -> None:
    if tuple(got) != tuple(want):
        raise ValueError(f"{param_name}: checkpoint tensor has shape {tuple(got)}, expected {tuple(want)}")


class _Linear(nn.Module):
    """Bias-free linear over a local [out_local, in_local] weight (the thinker has no biases)."""

    def __init__(self, in_local: int, out_local: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_local, in_local), requires_grad=False)
        self.gemv: LinearKernel | None = None
        self.norm_gemv: NormedLinearKernel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.gemv)

    def normed(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This projection of norm(x + residual), and x + residual (residual None: of norm(x), and
        x): the decoder layer's add + norm before it, in one launch where `norm_gemv` serves."""
        if self.norm_gemv is not None:
            fused = self.norm_gemv(x, self.weight, norm.weight, norm.eps, residual)
            if fused is not None:
                return fused
        if residual is None:
            return self(norm(x)), x
        h, residual = norm(x, residual)
        return self(h), residual

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(type(self).__name__, loaded.shape, param.shape)
        param.data.copy_(loaded)


class MergedColumnParallelLinear(_Linear):
    """Several column-parallel projections fused in one weight (gate_proj + up_proj → gate_up_proj)."""

    def __init__(self, in_features: int, out_sizes: list[int], tp: TPGroup) -> None:
        self.tp = tp
        self.local_sizes = [divide(n, tp.size, "merged column-parallel output features") for n in out_sizes]
        super().__init__(in_features, sum(self.local_sizes))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        assert isinstance(shard_id, int)
        rows = self.local_sizes[shard_id]
        check_shape(type(self).__name__, loaded.shape, (rows * self.tp.size, param.shape[1]))
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, rows).copy_(loaded.narrow(0, self.tp.rank * rows, rows))


class QKVParallelLinear(_Linear):
    """Packed QKV: this rank's Q heads, then its K heads, then its V heads (column-parallel: a rank's
    heads are whole and its own, so a kernel norms and ropes them on the rank alone)."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, tp: TPGroup) -> None:
        self.tp, self.head_dim = tp, head_dim
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp.size, "attention heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = divide(num_kv_heads, tp.size, "KV heads")
        else:
            divide(tp.size, num_kv_heads, "(replicated) KV heads: tp_size must be a multiple of them;")
            self.num_kv_heads = 1
        super().__init__(hidden, (self.num_heads + 2 * self.num_kv_heads) * head_dim)
        self.rope_gemv: NormedRopeKernel | None = None

    def normed_roped(
        self, x: torch.Tensor, norm: RMSNorm, residual: torch.Tensor | None, qk_rope: tuple, apart: bool
    ) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """`normed`'s (qkv, x + residual), and whether its q and k heads are QK-normed and roped
        already (`qk_rope`, a QKNormRope): in the same launch where `rope_gemv` serves (its rule,
        `resident_gemv.rope_epilogue_applies`: `apart`, the attention would apply it in a launch of
        its own); else False, q and k raw."""
        if self.rope_gemv is not None:
            heads = (self.num_heads, self.num_kv_heads, self.head_dim)
            fused = self.rope_gemv(x, self.weight, norm.weight, norm.eps, residual, (heads, qk_rope), apart)
            if fused is not None:
                return *fused, True
        return *self.normed(x, norm, residual), False

    def kv_head_start(self) -> int:
        """First global KV head of this rank (ranks share a KV head when there are fewer heads than ranks)."""
        if self.total_kv_heads >= self.tp.size:
            return self.tp.rank * self.num_kv_heads
        return self.tp.rank * self.total_kv_heads // self.tp.size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        d = self.head_dim
        want = ((self.total_heads + 2 * self.total_kv_heads) * d, param.shape[1])
        check_shape(type(self).__name__, loaded.shape, want)
        q_rows, kv_rows = self.num_heads * d, self.num_kv_heads * d
        q = loaded.narrow(0, self.tp.rank * q_rows, q_rows)
        k_base = self.total_heads * d
        v_base = k_base + self.total_kv_heads * d
        kv0 = self.kv_head_start() * d
        param.data[:q_rows].copy_(q)
        param.data[q_rows : q_rows + kv_rows].copy_(loaded.narrow(0, k_base + kv0, kv_rows))
        param.data[q_rows + kv_rows :].copy_(loaded.narrow(0, v_base + kv0, kv_rows))


class RowParallelLinear(_Linear):
    """Input columns split across ranks; partial outputs summed with one all-reduce (optional)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, reduce: bool = True) -> None:
        self.tp, self.reduce = tp, reduce
        super().__init__(divide(in_features, tp.size, "row-parallel input features"), out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = project(x, self.weight, self.gemv)
        return self.tp.all_reduce(y) if self.reduce else y

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        cols = param.shape[1]
        check_shape(type(self).__name__, loaded.shape, (param.shape[0], cols * self.tp.size))
        param.data.copy_(loaded.narrow(1, self.tp.rank * cols, cols))
