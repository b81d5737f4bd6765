"""PeerAllReduce: the TP group's sum for small messages, one launch over the ranks' peer blocks.

`TPGroup.all_reduce` hands it a message when `takes` says so (the same answer on every rank: it
reads only the message's dtype, size, layout and device); torch.distributed sums the rest. The
kernel's wait for the peers is bounded: past the deadline it records the rank it waited for in a
host word (pinned memory, read without a sync) and the next of the group's collectives raises
`PeerAllReduceStalled` naming that rank (`check`, run by TPControl before each of them).

The kernel module (triton) is imported only where the peer path is set up: a CPU install needs no
triton, and the tests' interpreter mode is chosen before triton is first imported.
"""

from __future__ import annotations

from types import ModuleType

import torch
from omnistage.services.thinker.tp.peer_blocks import PeerBlocks

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Largest message the peer path sums (a decode step's is hidden × batch × 2 bytes: 8 KiB a token
# for Ming, so decode batches of up to 16); larger ones (big batches, prefill) go to NCCL. Also each
# block's half. Measured on 2 × H200 over NVLink (bench/allreduce_gpu.sh, graph replays, µs a call,
# bf16 peer vs NCCL; bench/RESULTS.md 2026-11-29 session 7): the peer path wins up to 128 KiB
# (4 KiB 5.4 vs 11.5, 64 KiB 6.6 vs 12.4, 128 KiB 8.8 vs 12.7), NCCL from 256 KiB (14.1 vs 13.8,
# 512 KiB 23.3 vs 15.0, 1 MiB 41.8 vs 19.2; fp32 crosses at ~512 KiB, but a decode step's messages
# are bf16). Through the engine (Ming-flash TP=2) the peer path up to 512 KiB gained 5 % at c=1 and
# lost 1-3 % at c=32 and 64, whose 256 / 512 KiB messages now go to NCCL.
MAX_MESSAGE_BYTES = 128 * 1024
NO_POLL_LIMIT = 1 << 62  # a GPU's wait is bounded by its clock; polls bound it under the interpreter


class PeerAllReduceStalled(RuntimeError):
    """A peer all-reduce waited past its deadline for a rank that never reached the same call."""

    def __init__(self, rank: int, late_rank: int, call: int, timeout_s: float) -> None:
        super().__init__(
            f"rank {rank}: peer all-reduce call {call} waited {timeout_s:g}s for rank {late_rank}, "
            "which never reached it"
        )
        self.culprit_rank = late_rank  # read by TPControl.guard: the group's failure names it


class PeerAllReduce:
    """This rank's side of the one-shot all-reduce (owns its blocks: `close` frees them)."""

    def __init__(
        self,
        blocks: PeerBlocks,
        device: torch.device,
        timeout_s: float,
        capacity_bytes: int = MAX_MESSAGE_BYTES,
        programs: int = 16,
        max_polls: int = NO_POLL_LIMIT,
    ) -> None:
        """`blocks`: every rank's, laid out for `capacity_bytes` (`block_bytes`); `programs`: the
        same on every rank for the blocks' life."""
        kernel = self.kernel = _kernel()
        world = len(blocks.blocks)
        self.launch = kernel.PeerLaunch(world, blocks.rank, capacity_bytes, programs)
        self.blocks, self.device, self.timeout_s = blocks, device, timeout_s
        # The kernel writes here when a wait times out; the host reads it with no device sync.
        self.host_error = torch.zeros(1, dtype=torch.int64, pin_memory=device.type == "cuda")
        words = blocks.addresses + [0] * kernel.TABLE_EXTRA
        words[world + kernel.HOST_ERROR_SLOT.value] = self.host_error.data_ptr()
        words[world + kernel.TIMEOUT_NS_SLOT.value] = _ns(timeout_s)
        words[world + kernel.MAX_POLLS_SLOT.value] = max_polls
        self.table = torch.tensor(words, dtype=torch.int64, device=device)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether this sum serves `x`: a contiguous bf16/fp16/fp32 message on this rank's device,
        of at most MAX_MESSAGE_BYTES (and the block's half), while the blocks are open."""
        nbytes = x.numel() * x.element_size()
        return (
            not self.blocks.closed
            and x.device == self.device
            and x.dtype in DTYPES
            and x.is_contiguous()
            and 0 < nbytes <= self.launch.capacity_bytes
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks in place (fp32 accumulation in rank order: the same bits on every
        rank) and return it."""
        return self.kernel.one_shot_all_reduce(x, self.table, self.launch)

    def set_timeout(self, timeout_s: float) -> None:
        """The wait's deadline from now on (graphs captured before read it too: it is on the device)."""
        self.timeout_s = timeout_s
        self.table[self.launch.world + self.kernel.TIMEOUT_NS_SLOT.value] = _ns(timeout_s)

    def check(self) -> None:
        """Raise PeerAllReduceStalled when a launch timed out waiting for a peer (no device sync)."""
        word = int(self.host_error[0])
        if word:
            call, late = self.kernel.decode_error(word)
            raise PeerAllReduceStalled(self.launch.rank, late, call, self.timeout_s)

    def close(self) -> None:
        """Free this rank's block and close the peers' (the group is leaving; `takes` is False after)."""
        self.blocks.close()


def block_bytes(capacity_bytes: int = MAX_MESSAGE_BYTES) -> int:
    """Bytes of one rank's block for messages of up to `capacity_bytes`."""
    return _kernel().block_bytes(capacity_bytes)


def max_ranks() -> int:
    """The most ranks the kernel's flags serve."""
    return _kernel().MAX_WORLD.value


def _kernel() -> ModuleType:
    from omnistage.services.thinker.kernels import peer_allreduce

    return peer_allreduce


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
