"""The kernel seam: which code runs the thinker's attention and routed experts."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

import torch
from omnistage.common.config import ATTENTION_BACKENDS, MOE_BACKENDS
from omnistage.common.log import get_logger
from omnistage.services.thinker.kernels import interpreting, triton_available
from omnistage.services.thinker.kernels.flashinfer_attention import FlashInferPrefill, flashinfer_unavailable
from omnistage.services.thinker.models.layers.attention import (
    TORCH_ATTENTION,
    AttentionMetadata,
    PagedAttention,
    QKNormRope,
)
from omnistage.services.thinker.models.layers.embed_head import VocabParallelEmbedding
from omnistage.services.thinker.models.layers.moe import FusedExperts, GatedMLP, Router, SparseMoeBlock
from omnistage.services.thinker.models.layers.norm import RMSNorm
from torch import nn

log = get_logger(__name__)


class BackendError(ValueError):
    """The asked backend cannot run here (says why and what would)."""


@dataclass(frozen=True)
class Backends:
    """What the model runs on; `graph_safe` when a decode step can be captured as a CUDA graph.

    `attention` names the prefill (and mixed) steps' kernel: torch | triton | flashinfer. Decode
    steps run the Triton paged decode kernel under both triton and flashinfer (graph-safe: lengths
    read on the device), the reference under torch."""

    attention: str
    moe: str

    @property
    def graph_safe(self) -> bool:
        return self.attention in ("triton", "flashinfer") and self.moe == "triton"


# `auto`'s attention for prefill steps on CUDA: the first of these that runs here. The order is the
# side-by-side measurement's verdict (bench/prefill_ttft.py, bench/RESULTS.md); decode steps always
# run the Triton kernel, which CUDA graphs capture.
AUTO_PREFILL_ATTENTION = ("flashinfer", "triton")


def resolve_backends(
    attention: str, moe: str, device: torch.device, block_size: int, head_dim: int
) -> Backends:
    """`auto` → the fastest kernels this device runs (AUTO_PREFILL_ATTENTION for attention, triton
    experts on CUDA), else torch. An explicit triton that cannot run here is refused; an explicit
    flashinfer that cannot falls back to what auto would pick without it, with one log line."""
    if attention not in ATTENTION_BACKENDS:
        raise BackendError(
            f"attention backend {attention!r}: expected one of {', '.join(ATTENTION_BACKENDS)}"
        )
    if moe not in MOE_BACKENDS:
        raise BackendError(f"moe backend {moe!r}: expected one of {', '.join(MOE_BACKENDS)}")
    runs_triton = triton_available() and (device.type == "cuda" or interpreting())
    shapes_ok = block_size >= 16 and _pow2(block_size) and head_dim >= 16 and _pow2(head_dim)
    fast_attention = runs_triton and device.type == "cuda" and shapes_ok

    def pick(name: str, what: str, needs_shapes: bool) -> str:
        if name == "auto":
            return (
                "triton"
                if runs_triton and device.type == "cuda" and (shapes_ok or not needs_shapes)
                else "torch"
            )
        if name == "triton" and not runs_triton:
            raise BackendError(
                f"{what}_backend triton needs a CUDA device and the triton package (device {device})"
            )
        if name == "triton" and needs_shapes and not shapes_ok:
            raise BackendError(
                f"attention_backend triton needs block_size >= 16 and head_dim >= 16, both powers of two "
                f"(block_size {block_size}, head_dim {head_dim})"
            )
        return name

    if attention in ("auto", "flashinfer"):
        chosen = _pick_prefill_attention(attention, device, fast_attention)
    else:
        chosen = pick(attention, "attention", True)
    return Backends(chosen, pick(moe, "moe", False))


def _pick_prefill_attention(asked: str, device: torch.device, fast: bool) -> str:
    """auto or flashinfer: FlashInfer where it runs (and the fast kernels do), else triton, else torch."""
    fallback = "triton" if fast else "torch"
    if not fast:
        if asked == "flashinfer":
            log.warning("attention_backend flashinfer: the fast kernels do not run here; %s serves", fallback)
        return fallback
    order = AUTO_PREFILL_ATTENTION if asked == "auto" else ("flashinfer",)
    for name in order:
        if name != "flashinfer":
            return name
        why = flashinfer_unavailable(device)
        if not why:
            return "flashinfer"
        log.log(
            logging.WARNING if asked == "flashinfer" else logging.INFO, "attention: no FlashInfer (%s)", why
        )
    return fallback


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# Set to `off`: the MoE layer's launches unfused (router GEMV in torch, four-launch alignment, torch
# combine), for a same-build comparison of a decode step's kernels (bench/ling_mini_gpu.py --fusions).
FUSIONS_ENV = "OMNISTAGE_THINKER_FUSIONS"


# Set to `on`: the projections (attention, dense MLP, shared expert, LM head) of a decode step's few
# tokens through the Triton GEMV where its shape measured faster than cuBLAS (kernels/gemv.py). Off
# by default: on one H200 the Ling-mini decode step was slower with it (c=1 569 -> 505 tok/s, the
# same kernel time; bench/RESULTS.md), so F.linear (cuBLAS) serves until that is understood.
GEMV_ENV = "OMNISTAGE_THINKER_GEMV"


# Set to `off`: a decode step's projections of one or two tokens without the weights-first kernel
# (`kernels/resident_gemv.py`: each program's weight rows read before the PDL wait, the add + RMSNorm
# before the qkv projection in the same launch), for a same-build comparison
# (bench/ling_mini_gpu.py --resident).
RESIDENT_ENV = "OMNISTAGE_THINKER_RESIDENT"


# Set to `on`: a decode step's qkv projection of one or two tokens does the QK-norm + rope of its q and
# k heads in its launch (`kernels/resident_gemv.py` `normed_qkv_rope`, where the attention would run it
# in a launch of its own: one sequence's decode on a GPU, a prefill of one or two tokens), for a
# same-build comparison (bench/decode_variants_gpu.sh). Off by default: the whole decode measured no
# faster with it (bench/RESULTS.md 2026-11-30: Ling-mini c=1 +0.2 %, c=2 -0.9 %; Ming-flash's TP=2
# rank c=1 -1.4 %).
QKV_ROPE_ENV = "OMNISTAGE_THINKER_QKV_ROPE"
# Where a MoE layer of one token selects its experts: `auto` (default) in the streaming gate-up launch
# at a hidden size up to SELECT_MAX_HIDDEN, else in the router's launch; `on` in the gate-up at every
# size, `off` in the router's at every size (there the router's launch gives the logits only, the down
# reads the ids after its wait; `kernels/gate_up_select.py`), for a same-build comparison
# (bench/decode_variants_gpu.sh).
GATEUP_SELECT_ENV = "OMNISTAGE_THINKER_GATEUP_SELECT"
# The whole decode at c=1, bench/RESULTS.md 2026-11-30: the gate-up selecting, Ling-mini (hidden 2,048,
# one H200) 955.8 → 973.5 tok/s; Ming-flash's TP=2 rank (hidden 4,096, 2 × H200) 352.9 → 345.9.
SELECT_MAX_HIDDEN = 2048
# Set to `on`: where GATEUP_SELECT_ENV selects, the down launch may read the ids and issue its chosen
# experts' rows before its PDL wait, on the gate-up's ids-ready flag (`kernels/ready_flag.py`). Off by
# default: the whole decode measured the same with it (Ling-mini c=1 973.5 vs 974.0 tok/s off, one H200,
# 2026-11-30), for a same-build comparison (bench/decode_variants_gpu.sh).
DOWN_FLAG_ENV = "OMNISTAGE_THINKER_DOWN_FLAG"
# Set to `P,W` or `P,W,M` (e.g. `2,4` or `2,4,256`): each decode attention program reads its first P
# tiles before its PDL wait, in W warps, a split taking at least M tokens (`paged_attention.DecodeTiles`;
# unset: `paged_attention.default_tiles`), for a same-build comparison (bench/decode_variants_gpu.sh;
# bench/attention_decode_gpu.py --preload times the kernel alone).
DECODE_TILES_ENV = "OMNISTAGE_THINKER_DECODE_TILES"


# Set to `off`: a decode step of one or two sequences copies its inputs on the compute stream after the
# step before, as larger ones do (`engine/decode_staging.py`; one graph a size), for a same-build
# comparison (bench/decode_variants_gpu.sh).
STAGE_OVERLAP_ENV = "OMNISTAGE_THINKER_STAGE_OVERLAP"


# Set to `off`: the embedding lookup of every step in torch (the placeholders' resolution, the
# clamp, the gather and under TP the shard mask: ~6 launches at a decode step's start) instead of
# one launch (`kernels/embed_gather.py`), for a same-build comparison (bench/ling_mini_gpu.py
# --fused-embed).
FUSED_EMBED_ENV = "OMNISTAGE_THINKER_FUSED_EMBED"


# Set to `off`: the dense MLP's gate-up of one or two tokens through its projection (cuBLAS, or the
# kernels above) and then the SiLU·mul launch, not the one streaming launch of both
# (`kernels/dense_gate_up.py`), for a same-build comparison.
DENSE_GATEUP_ENV = "OMNISTAGE_THINKER_DENSE_GATEUP"


def fusions_enabled() -> bool:
    """The environment's choice (default on); anything but on / off is refused, naming both."""
    return _switch(FUSIONS_ENV)


def gemv_enabled() -> bool:
    """GEMV_ENV's choice (default off), refused as FUSIONS_ENV's is."""
    return _switch(GEMV_ENV, default="off")


def resident_enabled() -> bool:
    """RESIDENT_ENV's choice (default on), refused as FUSIONS_ENV's is."""
    return _switch(RESIDENT_ENV)


def qkv_rope_enabled() -> bool:
    """QKV_ROPE_ENV's choice (default off), refused as FUSIONS_ENV's is."""
    return _switch(QKV_ROPE_ENV, default="off")


def gateup_select(hidden: int) -> bool:
    """Whether a MoE layer of `hidden` selects one token's experts in its gate-up launch:
    GATEUP_SELECT_ENV's choice (`auto`: up to SELECT_MAX_HIDDEN); anything else refused, naming it."""
    value = os.environ.get(GATEUP_SELECT_ENV, "auto").strip().lower()
    if value not in ("auto", "on", "off"):
        raise BackendError(f"{GATEUP_SELECT_ENV}={value!r}: expected auto, on or off")
    return value == "on" or (value == "auto" and hidden <= SELECT_MAX_HIDDEN)


def down_flag_enabled() -> bool:
    """DOWN_FLAG_ENV's choice (default off), refused as FUSIONS_ENV's is."""
    return _switch(DOWN_FLAG_ENV, default="off")


def decode_tiles(tiles_type: type) -> object | None:
    """DECODE_TILES_ENV's `P,W[,M]` as a `tiles_type(preload_tiles=P, warps=W[, min_chunk=M])` (None
    when unset); anything else refused, naming the variable (the type checks the ranges)."""
    value = os.environ.get(DECODE_TILES_ENV, "").strip()
    if not value:
        return None
    try:
        numbers = [int(x) for x in value.split(",")]
        if len(numbers) not in (2, 3):
            raise ValueError(f"{len(numbers)} numbers")
        names = ("preload_tiles", "warps", "min_chunk")
        return tiles_type(**dict(zip(names, numbers, strict=False)))
    except ValueError as exc:
        raise BackendError(
            f"{DECODE_TILES_ENV}={value!r}: expected P,W[,M] (tiles before the wait, warps, a split's "
            f"fewest tokens): {exc}"
        ) from exc


def stage_overlap_enabled() -> bool:
    """STAGE_OVERLAP_ENV's choice (default on), refused as FUSIONS_ENV's is."""
    return _switch(STAGE_OVERLAP_ENV)


def fused_embed_enabled() -> bool:
    """FUSED_EMBED_ENV's choice (default on), refused as FUSIONS_ENV's is."""
    return _switch(FUSED_EMBED_ENV)


def dense_gateup_enabled() -> bool:
    """DENSE_GATEUP_ENV's choice (default on), refused as FUSIONS_ENV's is."""
    return _switch(DENSE_GATEUP_ENV)


def _switch(name: str, default: str = "on") -> bool:
    value = os.environ.get(name, default).strip().lower()
    if value not in ("on", "off"):
        raise BackendError(f"{name}={value!r}: expected on or off")
    return value == "on"


def install_backends(model: nn.Module, backends: Backends, fuse: bool | None = None) -> None:
    """Point every layer of `model` at the chosen kernels (None everywhere: the reference).

    attention triton / flashinfer: paged attention + KV writes + QK-norm and rope (`TritonAttention`:
    in a decode step all in the attention launch), and the element-wise work around it (RMSNorm with
    its residual add, SiLU·mul of the dense and shared-expert MLPs) one launch each. moe triton: the
    router (gate GEMV + group-limited top-k in one launch for decode batches) and the routed experts
    (alignment, two GEMMs, and the sum over each token's experts with the shared expert's add; one
    token's experts in two launches, `kernels/moe_one_token.py`). Both (and `fuse`): a MoE layer's
    add + RMSNorm before a router of one or two tokens in the router's launch
    (`Router.norm_kernel`, `router.normed_route`), and with GATEUP_SELECT_ENV on, at one token, the
    experts selected in the gate-up launch instead (`SparseMoeBlock.select_kernel`,
    `kernels/gate_up_select.py`).
    `fuse` (default: FUSIONS_ENV) False: the MoE glue unfused, and a decode step's K/V write and
    QK-norm + rope in launches of their own.
    Under the fast attention backends a projection of one or two tokens whose weight fits takes the
    weights-first kernel, the qkv projection with the add + norm before it (`kernels/resident_gemv.py`;
    unless `fuse` or RESIDENT_ENV is off) and, where the attention would QK-norm and rope q and k in
    a launch of their own, with that too (`resident_gemv.normed_qkv_rope`; unless QKV_ROPE_ENV is
    off), and the projections and the LM head the Triton GEMV for a decode step's few tokens
    (`kernels/gemv.py` `chooses_kernel`) when GEMV_ENV is on; the embedding looks a step's ids up in
    one launch (`kernels/embed_gather.py`) unless FUSED_EMBED_ENV is off. There too a dense MLP's
    gate-up and SiLU·mul of one or two tokens run in one streaming launch, at one token with the
    add + RMSNorm before it (`kernels/dense_gate_up.py`; unless `fuse` or DENSE_GATEUP_ENV is off)."""
    fuse = fusions_enabled() if fuse is None else fuse
    attention, norm, act, gemv, norm_gemv, rope_gemv = TORCH_ATTENTION, None, None, None, None, None
    if backends.attention in ("triton", "flashinfer"):
        from omnistage.services.thinker.kernels import norms

        attention = (TritonAttention if backends.attention == "triton" else FlashInferAttention)(fuse)
        norm, act = norms.rms_norm, norms.silu_and_mul
        gemv, norm_gemv, rope_gemv = _projection_kernels(fuse)
    embed, (gate_up_act, norm_gate_up_act) = _embed_kernel(backends), _dense_gate_up_kernel(backends, fuse)
    experts, route, normed_route, select = _moe_kernels(backends, fuse, norm is not None)
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.backend = attention
        elif isinstance(module, RMSNorm):
            module.kernel = norm
        elif isinstance(module, GatedMLP):
            module.act, module.gate_up_act, module.norm_gate_up_act = act, gate_up_act, norm_gate_up_act
        elif isinstance(module, VocabParallelEmbedding):
            module.kernel = embed
        elif hasattr(module, "gemv"):  # a projection or the LM head (layers/linear.py `project`)
            module.gemv = gemv
            if hasattr(module, "norm_gemv"):
                module.norm_gemv = norm_gemv
            if hasattr(module, "rope_gemv"):
                module.rope_gemv = rope_gemv
        elif isinstance(module, FusedExperts):
            module.kernel = experts if experts is None or _aligns(module.w13.shape[0]) else None
        elif isinstance(module, Router):
            runs = route is not None and _routes(module.weight.shape[0], module.n_group, module.top_k)
            module.kernel = route if runs else None
            module.norm_kernel = normed_route if runs else None
        elif isinstance(module, SparseMoeBlock):
            module.select_kernel = select if select and gateup_select(module.experts.w13.shape[2]) else None


def _moe_kernels(backends: Backends, fuse: bool, norms: bool) -> tuple:
    """The MoE layers' kernels (None each: the reference): the experts, the router, and with the
    fusions and the norm's kernel installed the router's add + norm fold and the one token's layer
    that selects in its gate-up launch (installed where `gateup_select` says; its down reading early
    on the ids-ready flag with DOWN_FLAG_ENV on)."""
    if backends.moe != "triton":
        return None, None, None, None
    from omnistage.services.thinker.kernels import router
    from omnistage.services.thinker.kernels.fused_moe import fused_experts

    experts = functools.partial(fused_experts, fuse=fuse)
    route = functools.partial(router.route, fuse=fuse)
    if not (fuse and norms):  # the router may fold the norm only where the norm's kernel is installed
        return experts, route, None, None
    from omnistage.services.thinker.kernels.gate_up_select import normed_select_experts

    select = functools.partial(normed_select_experts, flag=down_flag_enabled())
    return experts, route, router.normed_route, select


def _aligns(num_experts: int) -> bool:
    from omnistage.services.thinker.kernels.moe_align import align_supported

    return align_supported(num_experts)


def _routes(num_experts: int, n_group: int, top_k: int) -> bool:
    from omnistage.services.thinker.kernels.router import route_shapes_supported

    return route_shapes_supported(num_experts, n_group, top_k)


def _projection_kernels(fuse: bool) -> tuple:
    """Under the fast attention backends, the projections' (gemv, norm_gemv, rope_gemv): the
    weights-first kernel's (`kernels/resident_gemv.py`, with the tiled GEMV as its fallback when
    GEMV_ENV is on) unless `fuse` or RESIDENT_ENV is off, its QK-norm + rope epilogue unless
    QKV_ROPE_ENV is off too; else the tiled GEMV alone (GEMV_ENV on) or nothing."""
    gemv = None
    if gemv_enabled():
        from omnistage.services.thinker.kernels.gemv import linear as gemv
    if not (fuse and resident_enabled()):
        return gemv, None, None
    from omnistage.services.thinker.kernels import resident_gemv

    rope_gemv = resident_gemv.normed_qkv_rope if qkv_rope_enabled() else None
    return functools.partial(resident_gemv.linear, fallback=gemv), resident_gemv.normed_linear, rope_gemv


def _dense_gate_up_kernel(backends: Backends, fuse: bool) -> tuple:
    """A dense MLP's (gate_up_act, norm_gate_up_act): the gate-up + SiLU·mul of one or two tokens
    in one launch, and of one token with the add + RMSNorm before it folded in
    (`kernels/dense_gate_up.py` `gate_up_act`, `normed_gate_up_act`), under the fast attention
    backends (whose norm kernel the fold matches bit for bit) with `fuse` unless DENSE_GATEUP_ENV
    is off; (None, None): the norm, the projection, then the SiLU·mul launch."""
    if backends.attention not in ("triton", "flashinfer") or not (fuse and dense_gateup_enabled()):
        return None, None
    from omnistage.services.thinker.kernels.dense_gate_up import gate_up_act, normed_gate_up_act

    return gate_up_act, normed_gate_up_act


def _embed_kernel(backends: Backends):
    """The embedding's one-launch lookup (`kernels/embed_gather.py` `rows`) under the fast attention
    backends unless FUSED_EMBED_ENV is off; None: the torch reference."""
    if backends.attention not in ("triton", "flashinfer") or not fused_embed_enabled():
        return None
    from omnistage.services.thinker.kernels.embed_gather import rows

    return rows


class TritonAttention:
    """QK-norm + rope, KV writes, decode steps and prefill / mixed steps in Triton: the prefill kernel
    takes every sequence of the step (decode rows too) through a tile table made once per step
    (`step_state`); decode steps read their lengths on the device (graph-safe).

    A decode step with `fuse`: `paged_decode` writes the new K/V itself and, where it pays
    (`paged_attention.folds_qk_rope`: few context splits a sequence), norms and ropes q and the new K
    on load (`qk_rope`): one launch a layer; elsewhere QK-norm + rope runs in its own launch first. Otherwise (a prefill or mixed step, no
    cache, `fuse` off: the same build's unfused comparison) QK-norm + rope is a launch of its own
    in place on the q and k rows (`norms.qk_norm_rope`, the same rule), then the K/V write, then
    the attention. Where QK-norm + rope would be a launch of its own (`qk_rope_apart`) the qkv
    projection of one or two tokens may have applied it in its launch already: q and k come
    normed and roped, without `qk_rope`, and the K stored is that one."""

    def __init__(self, fuse: bool = True) -> None:
        from omnistage.services.thinker.kernels import norms, paged_attention, paged_prefill

        self.kernels = paged_attention
        self.prefill_kernels = paged_prefill
        self.norms = norms
        self.fuse = fuse  # a decode step's K/V write and QK-norm + rope in its attention launch
        self.decode_tiles = decode_tiles(paged_attention.DecodeTiles)  # None: the kernel's default

    def forward(
        self,
        layer: PagedAttention,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        md: AttentionMetadata,
        qk_rope: QKNormRope | None = None,
    ) -> torch.Tensor:
        cached = md.slot_mapping is not None and layer.has_cache
        fold = cached and md.is_decode and self.fuse
        apart = self.qk_rope_apart(layer, q.shape[0], md)
        if qk_rope is not None and apart:
            self.norms.qk_norm_rope(q, k, *qk_rope)
        if not cached:
            return TORCH_ATTENTION.forward(layer, q, k, v, md)
        new_kv = (k, v, md.slot_mapping) if fold else None
        if new_kv is None:
            self.kernels.write_kv(k, v, layer.k_cache, layer.v_cache, md.slot_mapping)
        if md.is_decode:
            lens = md.context_lens_tensor
            if lens is None:
                lens = torch.tensor(md.context_lens, dtype=torch.int32, device=q.device)
            return self.kernels.paged_decode(
                q,
                layer.k_cache,
                layer.v_cache,
                md.block_tables,
                lens,
                layer.scale,
                new_kv,
                qk_rope=None if apart else qk_rope,
                tiles=self.decode_tiles,
            )
        return self.prefill(layer, q, md)

    def qk_rope_apart(self, layer: PagedAttention, num_tokens: int, md: AttentionMetadata) -> bool:
        """Whether this step's QK-norm + rope is a launch of its own: all but a decode step with the
        fusions on whose launch folds it (`paged_attention.folds_qk_rope`: few context splits a
        sequence). `forward` follows it, and so does the qkv projection's epilogue
        (`resident_gemv.rope_epilogue_applies`), which takes the launch on where it serves."""
        fold = md.slot_mapping is not None and layer.has_cache and md.is_decode and self.fuse
        return not (
            fold and self.kernels.folds_qk_rope(num_tokens, layer.num_kv_heads, layer.k_cache.is_cuda)
        )

    def prefill(self, layer: PagedAttention, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        graph_tiles = md.step_state.get("graph_tiles")  # a prefill graph's staged, padded table
        if graph_tiles is not None:  # its padding tokens are in no tile: their rows are zeroed
            return self.prefill_kernels.paged_prefill(
                q, layer.k_cache, layer.v_cache, md.block_tables, graph_tiles, layer.scale, zero_rows=True
            )
        tiles = md.step_state.get("triton_tiles")
        if tiles is None:
            block_q = self.prefill_kernels.tile_tokens(layer.num_heads, layer.num_kv_heads)
            tiles = self.prefill_kernels.prefill_tiles(md.query_lens, md.context_lens, block_q)
            tiles = md.step_state["triton_tiles"] = tiles.to(q.device, non_blocking=True)
        return self.prefill_kernels.paged_prefill(
            q, layer.k_cache, layer.v_cache, md.block_tables, tiles, layer.scale
        )


class FlashInferAttention(TritonAttention):
    """Prefill and mixed steps through FlashInfer (planned once per step), everything else as
    TritonAttention; when FlashInfer fails here (import, build, plan, dtype) the Triton prefill
    kernel serves from then on (one log line)."""

    def __init__(self, fuse: bool = True) -> None:
        super().__init__(fuse)
        self.flashinfer = FlashInferPrefill()

    def prefill(self, layer: PagedAttention, q: torch.Tensor, md: AttentionMetadata) -> torch.Tensor:
        if "graph_tiles" in md.step_state:  # a prefill graph: FlashInfer plans on the host, Triton does not
            return super().prefill(layer, q, md)
        out = self.flashinfer.run(q, layer.k_cache, layer.v_cache, md, layer.scale)
        return super().prefill(layer, q, md) if out is None else out
