"""The blocks of the peer all-reduce: this rank's own, and its peers' mapped into this process.

Each rank allocates one zeroed block (kernels/peer_allreduce.py's layout), exports it once, and
opens every peer's export once at start-up; `PeerBlocks.close` drops them all with the TP group.
How a block travels is a `BlockSharing`: CUDA IPC between GPU processes (`CudaIpcSharing`), a
file-backed mapping between CPU processes in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

Gather = Callable[[object, str], list]  # (this rank's value, what) -> every rank's, in rank order

# A block's base must keep the kernel's 16-byte vector loads aligned (the allocator gives 512).
BLOCK_ALIGNMENT = 256


class BlockSharing(Protocol):
    """How a rank's block reaches its peers."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        """This rank's block: `nbytes` zeroed bytes, ready to export."""
        ...

    def export(self, block: torch.Tensor) -> object:
        """What a peer needs to open `block` (picklable)."""
        ...

    def open(self, handle: object) -> torch.Tensor:
        """A peer's block, mapped in this process (uint8)."""
        ...


class CudaIpcSharing:
    """CUDA IPC through torch's storage sharing: the export is the handle of the block's allocation
    and its offset. A peer's block is opened on this rank's own device (lazy peer access), so no
    CUDA context is made on the peer's GPU; the block is zeroed and synchronised before export, so
    opening waits on no event."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocate(self, nbytes: int) -> torch.Tensor:
        block = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        torch.cuda.current_stream(self.device).synchronize()
        return block

    def export(self, block: torch.Tensor) -> object:
        _device, handle, size, offset, counter, counter_offset, _event, _sync = (
            block.untyped_storage()._share_cuda_()
        )
        return handle, size, offset, counter, counter_offset, block.storage_offset(), block.numel()

    def open(self, handle: object) -> torch.Tensor:
        ipc, size, offset, counter, counter_offset, start, numel = handle  # type: ignore[misc]
        storage = torch.UntypedStorage._new_shared_cuda(
            self.device.index, ipc, size, offset, counter, counter_offset, b"", False
        )
        block = torch.empty(0, dtype=torch.uint8, device=self.device)
        return block.set_(storage, start, (numel,))


@dataclass
class PeerBlocks:
    """Every rank's block as this process sees it (its own at `rank`), until `close`."""

    rank: int
    blocks: list[torch.Tensor] = field(default_factory=list)

    @property
    def addresses(self) -> list[int]:
        return [b.data_ptr() for b in self.blocks]

    @property
    def closed(self) -> bool:
        return not self.blocks

    def close(self) -> None:
        """Drop the peers' mappings (torch closes each IPC handle with its last reference) and this
        rank's block (kept by torch until every peer has closed its mapping of it)."""
        self.blocks = []


def open_peer_blocks(rank: int, world: int, nbytes: int, sharing: BlockSharing, gather: Gather) -> PeerBlocks:
    """Allocate and export this rank's block and open every peer's. Every rank joins the one
    collective (`gather`), its own block or not; a failure raises after it, with what was opened
    closed (the caller agrees with the other ranks on it)."""
    own, handle, failed = None, None, None
    try:
        own = sharing.allocate(nbytes)
        _check(own, rank, nbytes)
        handle = sharing.export(own)
    except Exception as exc:  # noqa: BLE001 - raised after the collective every rank joins
        failed = exc
    handles = gather(handle, "peer all-reduce: exchanging blocks")
    if failed is not None:
        raise failed
    missing = [r for r, h in enumerate(handles) if h is None]
    if missing:
        raise RuntimeError(f"ranks {missing} have no peer block to share")
    blocks = PeerBlocks(rank)
    try:
        for r in range(world):
            blocks.blocks.append(own if r == rank else _check(sharing.open(handles[r]), r, nbytes))
    except Exception:
        blocks.close()
        raise
    return blocks


def _check(block: torch.Tensor, rank: int, nbytes: int) -> torch.Tensor:
    if block.numel() < nbytes or block.data_ptr() % BLOCK_ALIGNMENT:
        raise RuntimeError(
            f"rank {rank}'s peer block: {block.numel()} bytes at {block.data_ptr():#x} "
            f"(need {nbytes}, {BLOCK_ALIGNMENT}-byte aligned)"
        )
    return block
