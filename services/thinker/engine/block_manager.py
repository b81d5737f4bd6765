"""The paged KV cache's bookkeeping: which blocks are free and which blocks each sequence owns.

Pure Python, no tensors: the model runner turns block tables into slot mappings. Blocks carry
reference counts so a block may be shared (e.g. a common prompt prefix); a block returns to the
free list only when its last owner lets go.
"""

from __future__ import annotations

from collections import deque

from omnistage.services.thinker.engine.sequence import Sequence


class BlockManager:
    """Fixed pool of `num_blocks` KV blocks of `block_size` tokens."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so that `num_new_tokens` more tokens of `seq` fit in its block table."""
        total = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow `seq.block_table` to hold `num_new_tokens` more tokens; the caller checked can_allocate."""
        needed = self.num_blocks_needed(seq, num_new_tokens)
        if needed > self.num_free_blocks:
            raise RuntimeError(
                f"KV cache: {seq.request_id} needs {needed} blocks, only {self.num_free_blocks} free"
            )
        for _ in range(needed):
            block_id = self.free_block_ids.popleft()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append blocks owned by another sequence to `seq` (their contents are already computed)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV cache: block {block_id} is free and cannot be shared")
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks (finish, abort, preemption); its cache is gone."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self.free_block_ids.append(block_id)
            elif self.ref_counts[block_id] < 0:
                raise RuntimeError(f"KV cache: block {block_id} freed more often than allocated")
        seq.block_table.clear()
        seq.num_computed_tokens = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot of the token at `position` in `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
