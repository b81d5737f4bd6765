"""On a GPU (skipped without CUDA): the dense MLP's gate-up + SiLU·mul launch
(`kernels/dense_gate_up.py`) at Ling-mini's and Ming-flash TP=2's dense shapes in bf16 is the eager
path's result (cuBLAS, then the SiLU·mul launch) within bf16 rounding and makes the reference's
roundings (from exact sums: all but a near-tie's few), and a CUDA graph of it after the kernel that
writes its input (both launched with PDL on Hopper) replays the eager bits with each replay's input;
with the add + RMSNorm folded in (`normed_gate_up_act`) the same, its residual sum and, at one token,
its output `norms.rms_norm` then the launch bit for bit. Here, not in kernels/, whose conftest runs Triton in its interpreter (whose casts to bf16 truncate)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda", 0)
# (hidden, this rank's dense intermediate): Ling-mini TP=1, Ming-flash TP=2 (9216 / 2).
SHAPES = {"ling-mini": (2048, 5120), "ming-flash-tp2": (4096, 4608)}


def _case(hidden: int, inter: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=CUDA, generator=g).bfloat16()
    w = (torch.randn(2 * inter, hidden, device=CUDA, generator=g) * 0.02).bfloat16()
    return x, w


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_launch_is_the_eager_path_within_bf16_and_rounds_as_the_reference(shape, tokens):
    from omnistage.services.thinker.kernels.dense_gate_up import chooses_kernel, silu_gate_up
    from omnistage.services.thinker.kernels.norms import silu_and_mul

    x, w = _case(*SHAPES[shape], tokens, seed=tokens)
    assert chooses_kernel(x, w)
    got = silu_gate_up(x, w)
    eager = silu_and_mul(F.linear(x, w))
    assert torch.allclose(got.float(), eager.float(), rtol=2e-2, atol=2e-2 * eager.abs().max().item())
    gate, up = F.linear(x.double(), w.double()).chunk(2, dim=-1)  # exact sums, then silu_mul's roundings
    gate = gate.bfloat16().double()
    want = ((gate * torch.sigmoid(gate)).bfloat16().double() * up.bfloat16().double()).bfloat16()
    same = (got == want).float().mean().item()
    assert same >= 0.99, f"{same:.4f} of the outputs round as the reference's"


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_graph_after_the_kernel_writing_its_input_replays_the_eager_bits(shape, tokens):
    from omnistage.services.thinker.kernels.dense_gate_up import silu_gate_up
    from omnistage.services.thinker.kernels.norms import rms_norm

    hidden, inter = SHAPES[shape]
    staged, w = _case(hidden, inter, tokens, seed=7)
    residual = torch.randn(tokens, hidden, device=CUDA).bfloat16()
    norm_w = (torch.rand(hidden, device=CUDA) + 0.5).bfloat16()

    def step() -> torch.Tensor:  # the decoder layer's post-attention add + norm, then the MLP's gate-up
        return silu_gate_up(rms_norm(staged, norm_w, 1e-6, residual)[0], w)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = step()
    for seed in range(4):
        staged.copy_(_case(hidden, inter, tokens, seed=100 + seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), f"replay {seed}"


def _normed_inputs(hidden: int, tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, the residual and a post-attention norm weight about 1, bf16 on the GPU."""
    g = torch.Generator(CUDA).manual_seed(seed)
    x = torch.randn(tokens, hidden, device=CUDA, generator=g).bfloat16()
    residual = torch.randn(tokens, hidden, device=CUDA, generator=g).bfloat16()
    return x, residual, (torch.rand(hidden, device=CUDA, generator=g) + 0.5).bfloat16()


@pytest.mark.parametrize("tokens", [1, 2])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_the_folded_norm_is_rms_norm_then_the_launch(shape, tokens):
    """The add + RMSNorm folded in (`normed_gate_up_act`'s launch): the residual sum is
    `norms.rms_norm`'s bit for bit, and the output the unfolded launch's of rms_norm's row -- bit
    for bit at one token (the fold's rule: the loop compiles as the unfolded one's), at two (the
    kernel takes them; LLVM orders the loop's fp32 sums otherwise there) within bf16 rounding,
    nearly every output the same bits."""
    from omnistage.services.thinker.kernels.dense_gate_up import silu_gate_up
    from omnistage.services.thinker.kernels.norms import rms_norm

    hidden, inter = SHAPES[shape]
    x, residual, norm_w = _normed_inputs(hidden, tokens, seed=tokens)
    w = _case(hidden, inter, tokens, seed=3)[1]
    got, total = silu_gate_up(x, w, norm=(norm_w, 1e-6), residual=residual)
    normed, want_total = rms_norm(x, norm_w, 1e-6, residual)
    want = silu_gate_up(normed, w)
    assert torch.equal(total, want_total)
    if tokens == 1:
        assert torch.equal(got, want)
        return
    assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2 * want.abs().max().item())
    same = (got == want).float().mean().item()
    assert same >= 0.99, f"{same:.4f} of the outputs are the unfolded launch's bits"


@pytest.mark.parametrize("shape", list(SHAPES))
def test_a_graph_of_the_folded_launch_replays_the_eager_bits(shape):
    """The decode step's one token: the folded launch after a kernel that writes its input (an
    RMSNorm standing in for the o projection, both launched with PDL on Hopper) in a CUDA graph,
    each replay's input."""
    from omnistage.services.thinker.kernels.dense_gate_up import normed_gate_up_act
    from omnistage.services.thinker.kernels.norms import rms_norm

    hidden, inter = SHAPES[shape]
    source, residual, norm_w = _normed_inputs(hidden, 1, seed=9)
    w = _case(hidden, inter, 1, seed=4)[1]
    ones = torch.ones(hidden, device=CUDA, dtype=torch.bfloat16)

    def step() -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm(source, ones, 1e-6)  # a kernel writing the launch's input right before it
        return normed_gate_up_act(x, w, norm_w, 1e-6, residual)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        assert step() is not None  # served (and compiled outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out, total = step()
    for seed in range(4):
        source.copy_(_normed_inputs(hidden, 1, seed=100 + seed)[0])
        graph.replay()
        torch.cuda.synchronize()
        want, want_total = step()
        assert torch.equal(out, want) and torch.equal(total, want_total), f"replay {seed}"
