"""The paged KV cache's bookkeeping: which blocks are free, which blocks each sequence owns, and
which full blocks hold a known prefix (prefix caching)."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from omnistage.services.thinker.engine.block_hash import BlockKey
from omnistage.services.thinker.engine.sequence import Sequence


@dataclass
class PrefixCacheStats:
    """Cumulative counts since start-up (read by the metrics)."""

    queried_tokens: int = 0  # tokens of sequences looked up at admission
    hit_tokens: int = 0  # of those, tokens taken from the cache
    evicted_blocks: int = 0  # indexed free blocks handed out for other content


class BlockManager:
    """Fixed pool of `num_blocks` KV blocks of `block_size` tokens; `caching` turns prefix reuse on."""

    def __init__(self, num_blocks: int, block_size: int, caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.ref_counts = [0] * num_blocks
        self.free_block_ids: deque[int] = deque(range(num_blocks))  # free, holding nothing indexed
        # Free but indexed (reusable K/V), least recently freed first: evicted from the front.
        self.cached_free: OrderedDict[int, None] = OrderedDict()
        self.index: dict[BlockKey, int] = {}  # key → block holding that content
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids) + len(self.cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix index (held or free)."""
        return len(self.index)

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
            block_id = self._take_free()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)

    def _take_free(self) -> int:
        """A free block for new content: a plain one, else the least recently freed indexed one."""
        if self.free_block_ids:
            return self.free_block_ids.popleft()
        block_id, _ = self.cached_free.popitem(last=False)
        del self.index[self.block_key[block_id]]
        self.block_key[block_id] = None
        self.stats.evicted_blocks += 1
        return block_id

    def share(self, seq: Sequence, block_ids: list[int]) -> None:
        """Append blocks owned by another sequence to `seq` (their contents are already computed)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"KV cache: block {block_id} is free and cannot be shared")
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)

    # --- prefix caching -------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Indexed blocks holding `seq`'s leading full blocks (a fresh sequence: nothing computed).

        At least the last known token is left to compute (its logits are needed), and a hidden-state
        request computes every slot it wants the hidden states of."""
        if not self.caching or seq.block_table:
            return []
        limit = seq.num_tokens - 1
        if seq.hidden is not None:
            limit = min(limit, int(seq.hidden.slots[0]))
        found = []
        for key in seq.keys_of_full_blocks(self.block_size, limit // self.block_size):
            block_id = self.index.get(key)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def num_reclaimed(self, block_ids: list[int]) -> int:
        """How many of these blocks taking them removes from the free pool (those nobody holds)."""
        return sum(self.ref_counts[b] == 0 for b in block_ids)

    def can_admit(self, seq: Sequence, prefix: list[int], num_new_tokens: int) -> bool:
        """Whether a fresh `seq` fits with `prefix` taken and `num_new_tokens` more tokens after it."""
        total = -(-(len(prefix) * self.block_size + num_new_tokens) // self.block_size)
        return total - len(prefix) + self.num_reclaimed(prefix) <= self.num_free_blocks

    def take_prefix(self, seq: Sequence, block_ids: list[int]) -> None:
        """Give a fresh `seq` the matched blocks: their tokens count as computed."""
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(f"KV cache: {seq.request_id} already holds blocks; a prefix goes first")
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self.cached_free[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
        seq.num_indexed_blocks = len(block_ids)
        seq.num_computed_tokens = len(block_ids) * self.block_size

    def record_lookup(self, seq: Sequence, num_hit_blocks: int) -> None:
        self.stats.queried_tokens += seq.num_tokens
        self.stats.hit_tokens += num_hit_blocks * self.block_size

    def index_computed(self, seq: Sequence) -> None:
        """Index the blocks `seq` has filled with computed tokens since the last call. A block whose
        content another block already holds stays out of the index (freed as a plain block)."""
        if not self.caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_indexed_blocks:
            return
        keys = seq.keys_of_full_blocks(self.block_size, full)
        for i in range(seq.num_indexed_blocks, full):
            block_id = seq.block_table[i]
            if keys[i] not in self.index and self.block_key[block_id] is None:
                self.index[keys[i]] = block_id
                self.block_key[block_id] = keys[i]
        seq.num_indexed_blocks = full

    # --- release --------------------------------------------------------------------------------

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's hold on its blocks (finish, abort, preemption); indexed blocks keep
        their content for later sequences until evicted."""
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_key[block_id] is not None:
                    self.cached_free[block_id] = None
                else:
                    self.free_block_ids.append(block_id)
            elif self.ref_counts[block_id] < 0:
                raise RuntimeError(f"KV cache: block {block_id} freed more often than allocated")
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_indexed_blocks = 0

    def slot(self, seq: Sequence, position: int) -> int:
        """Cache slot of the token at `position` in `seq`."""
        return seq.block_table[position // self.block_size] * self.block_size + position % self.block_size
