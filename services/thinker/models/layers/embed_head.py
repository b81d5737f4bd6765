"""Vocab-parallel embedding (masked lookup + all-reduce, multimodal rows spliced before the
all-reduce) and LM head (local logits + all-gather).

Each rank owns ceil(vocab / tp) rows; rows past the real vocabulary are zero padding and are cut
from the gathered logits, so callers always see exactly `vocab_size` columns (in the model's dtype).
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


class VocabParallelEmbedding(_VocabParallel):
    def forward(
        self,
        ids: torch.Tensor,
        splice_index: torch.Tensor | None = None,
        splice_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T] ids → [T, H] rows; rows `splice_index` are replaced by `splice_rows` (multimodal slots).

        Under TP only rank 0 needs `splice_rows`: it writes them into its partial sum, every other rank
        zeroes its partial there, and the all-reduce this layer does anyway delivers them exactly."""
        ids = ids.clamp(0, self.vocab_size - 1)
        if self.tp.size == 1:
            out = F.embedding(ids, self.weight)
            if splice_index is not None:
                out = out.index_copy(0, splice_index, splice_rows.to(out.dtype))
            return out
        mine = (ids >= self.start) & (ids < self.end)
        out = F.embedding(torch.where(mine, ids - self.start, 0), self.weight)
        out = out * mine[:, None].to(out.dtype)
        if splice_index is not None:
            if self.tp.rank == 0:
                out.index_copy_(0, splice_index, splice_rows.to(out.dtype))
            else:
                out.index_fill_(0, splice_index, 0)
        return self.tp.all_reduce(out)


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
