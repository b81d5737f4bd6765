"""The embedding lookup's one launch (kernels/embed_gather.py) under the interpreter: the torch
path's rows (`embed_head.embed_reference`) exactly, for placeholders and plain ids mixed, ids and
sampled ids out of range (clamped), every rank's shard of a vocabulary that TP does not divide
(zeros outside it), bf16 and fp32, 1, 2 and 17 tokens; the dispatch rule; the layer with the kernel
installed (multimodal rows spliced after the gather) gives the reference layer's rows; and the
switch reaches the layer and refuses a typo."""

from __future__ import annotations

import pytest
import torch
from omnistage.services.thinker.kernels import embed_gather
from omnistage.services.thinker.models.layers.embed_head import (
    VocabParallelEmbedding,
    embed_reference,
    resolve_placeholders,
)

VOCAB = 50


def _shards(tp: int) -> list[tuple[int, int, int]]:
    """(rows, start, end) of each rank's shard (embed_head._VocabParallel's split)."""
    rows = -(-VOCAB // tp)
    return [(rows, r * rows, min(VOCAB, r * rows + rows)) for r in range(tp)]


def _ids(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`tokens` ids drawn from plain ids, ids past the vocabulary and placeholders (some naming a
    row past the sampled ids), and the sampled ids [5] (one past the vocabulary, one negative)."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.tensor([0, 1, 7, 24, 25, 26, 49, 50, 99, 10**6, -1, -2, -3, -5, -6, -40])
    ids = pool[torch.randint(0, pool.numel(), (tokens,), generator=g)]
    if tokens >= 2:
        ids[:2] = torch.tensor([-1, VOCAB])  # a placeholder and an id past the vocabulary, every case
    return ids, torch.tensor([17, VOCAB + 3, -4, 33, 12])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 17])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_the_launch_gives_the_torch_rows_on_every_shard(launches, dtype, tokens, tp):
    launches.watch(embed_gather, "_embed_gather_kernel")
    g = torch.Generator().manual_seed(tp)
    full = torch.randn(VOCAB, 40, generator=g).to(dtype)
    ids, sampled = _ids(tokens, seed=tokens + 10 * tp)
    summed = torch.zeros(tokens, 40, dtype=torch.float64)
    for rows, start, end in _shards(tp):
        weight = torch.zeros(rows, 40, dtype=dtype)
        weight[: end - start] = full[start:end]  # rows past the vocabulary: zero padding
        for feed in (None, sampled):
            got = embed_gather.rows(ids, weight, VOCAB, start, end, feed)
            want = embed_reference(ids, weight, VOCAB, start, end, feed)
            assert got.dtype == dtype and got.shape == (tokens, 40)
            assert torch.equal(got, want), (start, feed is None)
        summed += got.double()  # the rows with the sampled ids
    # the ranks' rows add up to the full table's row of each resolved, clamped id (one rank owns it)
    resolved = resolve_placeholders(ids, sampled).clamp(0, VOCAB - 1)
    assert torch.equal(summed, full[resolved].double())
    assert launches.of("_embed_gather_kernel") == [((tokens, 1), None)] * (2 * tp)


def test_a_row_wider_than_a_block_takes_programs_side_by_side_and_no_tokens_launch_nothing(launches):
    launches.watch(embed_gather, "_embed_gather_kernel")
    hidden = embed_gather.BLOCK_H + 40
    weight = torch.randn(VOCAB, hidden)
    ids, sampled = _ids(3, seed=1)
    got = embed_gather.rows(ids, weight, VOCAB, 0, VOCAB, sampled)
    assert torch.equal(got, embed_reference(ids, weight, VOCAB, 0, VOCAB, sampled))
    assert embed_gather.rows(ids[:0], weight, VOCAB, 0, VOCAB, sampled).shape == (0, hidden)
    assert launches.of("_embed_gather_kernel") == [((3, 2), None)]


def test_the_dispatch_rule(monkeypatch):
    ids, sampled = _ids(4, seed=2)
    weight = torch.randn(VOCAB, 8)
    assert embed_gather.chooses_kernel(ids, weight, sampled) and embed_gather.chooses_kernel(
        ids.int(), weight
    )
    assert not embed_gather.chooses_kernel(ids.repeat(2)[::2], weight)  # strided ids
    assert not embed_gather.chooses_kernel(ids.float(), weight)
    assert not embed_gather.chooses_kernel(ids, weight, sampled[:0])  # nothing a placeholder can name
    assert not embed_gather.chooses_kernel(ids, weight.t())
    assert not embed_gather.chooses_kernel(ids[None], weight)
    assert embed_gather.rows(ids, weight.t(), VOCAB, 0, VOCAB) is None  # the caller's torch path serves
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU tensor outside the interpreter
    assert not embed_gather.chooses_kernel(ids, weight, sampled)


class _Rank:
    """A TP group of `size` seen from `rank` whose all-reduce is the identity (a partial sum)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.mark.parametrize("rank, size", [(0, 1), (0, 2), (1, 2)])
def test_the_layer_with_the_kernel_gives_the_reference_layers_rows_with_spliced_rows(launches, rank, size):
    launches.watch(embed_gather, "_embed_gather_kernel")
    layer = VocabParallelEmbedding(VOCAB, 24, _Rank(rank, size))
    layer.weight_loader(layer.weight, torch.randn(VOCAB, 24, generator=torch.Generator().manual_seed(3)))
    ids, sampled = _ids(6, seed=3)
    index, rows = torch.tensor([4, 1]), torch.randn(2, 24, dtype=torch.float64)
    want = layer(ids, index, rows, sampled)
    layer.kernel = embed_gather.rows
    assert torch.equal(layer(ids, index, rows, sampled), want)
    assert torch.equal(layer(ids), layer.local_rows(ids)) and len(launches.of("_embed_gather_kernel")) == 3
    layer.kernel = None
    assert torch.equal(layer(resolve_placeholders(ids, sampled)), layer(ids, sampled=sampled))


def test_the_switch_reaches_the_embedding_and_refuses_a_typo(tiny_ckpt, monkeypatch):
    from omnistage.services.thinker.models.layers.backends import (
        FUSED_EMBED_ENV,
        BackendError,
        Backends,
        install_backends,
    )
    from omnistage.services.thinker.models.loader import load_model

    model = load_model(str(tiny_ckpt), dtype=torch.float32, device="cpu")
    embedding = model.model.word_embeddings
    monkeypatch.delenv(FUSED_EMBED_ENV, raising=False)
    install_backends(model, Backends("triton", "triton"))
    assert embedding.kernel is embed_gather.rows  # on by default under the fast attention backends
    monkeypatch.setenv(FUSED_EMBED_ENV, " OFF ")
    install_backends(model, Backends("flashinfer", "triton"))
    assert embedding.kernel is None
    monkeypatch.setenv(FUSED_EMBED_ENV, "on")
    install_backends(model, Backends("torch", "triton"))  # the reference's attention: the torch lookup
    assert embedding.kernel is None
    monkeypatch.setenv(FUSED_EMBED_ENV, "yes")
    with pytest.raises(BackendError, match=f"{FUSED_EMBED_ENV}='yes': expected on or off"):
        install_backends(model, Backends("triton", "triton"))
