"""Vocab-parallel embedding (masked lookup + all-reduce, multimodal rows spliced before the
all-reduce) and LM head (local logits + all-gather).

Each rank owns ceil(vocab / tp) rows; rows past the real vocabulary are zero padding and are cut
from the gathered logits, so callers always see exactly `vocab_size` columns (in the model's dtype). The embedding takes
ids that may be placeholders for the step before's sampled ids (`resolve_placeholders`: async
scheduling's feed), resolved in the same lookup; on the fast backends one launch does the whole
lookup (kernels/embed_gather.py), `embed_reference` is the torch path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from omnistage.services.thinker.models.layers.linear import LinearKernel, check_shape, project
from omnistage.services.thinker.models.layers.parallel import TPGroup
from torch import nn


class _VocabParallel(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.end = min(vocab_size, self.start + self.rows)
        self.weight = nn.Parameter(torch.empty(self.rows, hidden), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        check_shape(type(self).__name__, loaded.shape, (self.vocab_size, param.shape[1]))
        n = max(0, self.end - self.start)
        param.data[:n].copy_(loaded[self.start : self.start + n])
        param.data[n:].zero_()


def resolve_placeholders(ids: torch.Tensor, sampled: torch.Tensor) -> torch.Tensor:
    """`ids` with each placeholder (row r's is -r - 1) replaced by `sampled[r]`, the rest as they
    are (a new tensor): the one rule, for an eager step (`SampledFeed.fill`) and in the lookup."""
    named = sampled[(-ids - 1).clamp(min=0, max=sampled.numel() - 1)]
    return torch.where(ids < 0, named, ids)


def embed_reference(
    ids: torch.Tensor,
    weight: torch.Tensor,
    vocab_size: int,
    start: int,
    end: int,
    sampled: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows [T, H] of ids [T] (placeholders named in `sampled`, then clamped into the vocabulary)
    from the shard `weight` of vocabulary rows [start, end), zero for an id outside it: the torch
    path (kernels/embed_gather.py does the same in one launch)."""
    if sampled is not None:
        ids = resolve_placeholders(ids, sampled)
    ids = ids.clamp(0, vocab_size - 1)
    if start == 0 and end >= vocab_size:  # the whole vocabulary (TP = 1)
        return F.embedding(ids, weight)
    mine = (ids >= start) & (ids < end)
    out = F.embedding(torch.where(mine, ids - start, 0), weight)
    return out * mine[:, None].to(out.dtype)


class VocabParallelEmbedding(_VocabParallel):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden, tp)
        # The one-launch lookup (`install_backends`: kernels/embed_gather.py `rows`, None where it
        # does not serve); None: `embed_reference`.
        self.kernel = None

    def forward(
        self,
        ids: torch.Tensor,
        splice_index: torch.Tensor | None = None,
        splice_rows: torch.Tensor | None = None,
        sampled: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids → [T, H] rows; rows `splice_index` are replaced by `splice_rows` (multimodal slots).
        With `sampled` [S] an id -r - 1 is a placeholder for `sampled[r]` (the step before's ids).

        Under TP only rank 0 needs `splice_rows`: it writes them into its partial sum, every other rank
        zeroes its partial there, and the all-reduce this layer does anyway delivers them exactly."""
        out = self.local_rows(ids, sampled)
        if self.tp.size == 1:
            if splice_index is not None:
                out = out.index_copy(0, splice_index, splice_rows.to(out.dtype))
            return out
        if splice_index is not None:
            if self.tp.rank == 0:
                out.index_copy_(0, splice_index, splice_rows.to(out.dtype))
            else:
                out.index_fill_(0, splice_index, 0)
        return self.tp.all_reduce(out)

    def local_rows(self, ids: torch.Tensor, sampled: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's rows [T, H] of `ids` (zero where another rank's shard holds the id): the
        installed kernel's where it serves, else the torch path's."""
        shard = (self.weight, self.vocab_size, self.start, self.end)
        out = None if self.kernel is None else self.kernel(ids, *shard, sampled)
        return embed_reference(ids, *shard, sampled) if out is None else out


class ParallelLMHead(_VocabParallel):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden, tp)
        self.gemv: LinearKernel | None = None  # the small-batch matmul (`install_backends`)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [R, H] → logits [R, vocab_size] over the full vocabulary, in the weight's dtype: a
        view of the projection's (gathered) output, no copy. No cast to fp32 here: the sampler casts
        what it reads values of (engine/sampler.py), its greedy argmax reads these as they are."""
        logits = self.tp.all_gather(project(hidden, self.weight, self.gemv), dim=-1)
        return logits[:, : self.vocab_size]
