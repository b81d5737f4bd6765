"""Which sum the TP group's all-reduce runs: decided once at start-up, the same on every rank.

The one-shot peer all-reduce (`peer_allreduce.py`) serves small messages where every rank can run
it; torch.distributed (NCCL on GPUs, gloo on CPUs) serves the rest, and everything when any rank
cannot. Every rank says what stops it and sees every rank's answer (a gather on the plan group), in
rounds: what each rank knows alone (`engine.tp_allreduce`, its device), whether it reaches every
peer's GPU, whether it opened every peer's block, whether the self-test summed right. All ranks see
the same answers, so all stop after the same round and run the same collectives: no collective on
some ranks only. Which messages the peer path takes once chosen is `PeerAllReduce.takes`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from omnistage.common.log import get_logger
from omnistage.services.thinker.kernels import triton_available
from omnistage.services.thinker.tp.peer_allreduce import (
    MAX_MESSAGE_BYTES,
    PeerAllReduce,
    PeerAllReduceStalled,
    block_bytes,
    max_ranks,
)
from omnistage.services.thinker.tp.peer_blocks import BlockSharing, CudaIpcSharing, open_peer_blocks

log = get_logger(__name__)

# The self-test's wait for the peers: they start it together (after a gather), so only the kernel's
# first compile on each rank separates them.
SELF_TEST_TIMEOUT_S = 60.0


class AgreeingGroup(Protocol):
    """What the choice needs of the TP group (TPControl)."""

    rank: int
    world_size: int

    def gather(self, value: object, what: str) -> list: ...


class PeerEnv(Protocol):
    """What the choice needs of this rank's device (`CudaPeers`; a fake on a CPU)."""

    device: torch.device
    sharing: BlockSharing

    def refusal(self) -> str | None: ...

    def identity(self) -> str: ...

    def unreachable(self, identity: str) -> str | None: ...

    def self_test(self, reducer: PeerAllReduce) -> str | None: ...


@dataclass(frozen=True)
class AllReduceChoice:
    """The path every rank of the group takes, and why (logged, and in the start-up summary)."""

    path: Literal["peer", "torch", "local"]
    reason: str
    reducer: PeerAllReduce | None = None

    @property
    def summary(self) -> str:
        if self.path == "peer":
            return (
                f"peer (one-shot over CUDA IPC for messages up to {MAX_MESSAGE_BYTES // 1024} KiB, "
                f"torch.distributed above): {self.reason}"
            )
        return f"{self.path}: {self.reason}"


def choose_all_reduce(
    group: AgreeingGroup, mode: str, device: torch.device, timeout_s: float, env: PeerEnv | None = None
) -> AllReduceChoice:
    """The group's all-reduce path (every rank calls this at the same point of start-up).
    `timeout_s`: the peer path's wait for a peer from the self-test on (start-up's deadline)."""
    if group.world_size == 1:
        return AllReduceChoice("local", "one rank: nothing to sum")
    env = env if env is not None else (CudaPeers(device) if device.type == "cuda" else None)
    refusal = _local_refusal(mode, group.world_size, device, env)
    answers = group.gather((refusal, env.identity() if refusal is None else ""), "peer all-reduce: devices")
    objection = _objection([why for why, _ in answers])
    if objection is None:
        assert env is not None
        unreachable = [env.unreachable(ident) for r, (_, ident) in enumerate(answers) if r != group.rank]
        objection = _agree(group, next((u for u in unreachable if u), None), "peer access")
    if objection is not None:
        return _torch(objection)
    assert env is not None
    return _set_up(group, env, timeout_s)


def _set_up(group: AgreeingGroup, env: PeerEnv, timeout_s: float) -> AllReduceChoice:
    """Open the blocks, then run the self-test: each step agreed on before the next."""
    reducer, why = None, None
    try:
        blocks = open_peer_blocks(group.rank, group.world_size, block_bytes(), env.sharing, group.gather)
        reducer = PeerAllReduce(blocks, env.device, SELF_TEST_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - any failure here is agreed on, then NCCL serves
        why = f"opening the peer blocks failed: {type(exc).__name__}: {exc}"
    objection = _agree(group, why, "blocks")
    if objection is None:
        assert reducer is not None
        objection = _agree(group, _self_test(env, reducer), "self-test")
    if objection is not None:
        if reducer is not None:
            reducer.close()
        return _torch(objection)
    assert reducer is not None
    reducer.set_timeout(timeout_s)
    world = group.world_size
    choice = AllReduceChoice("peer", f"every rank reaches every peer ({world} ranks)", reducer)
    log.info("tp all-reduce: %s", choice.summary)
    return choice


def _self_test(env: PeerEnv, reducer: PeerAllReduce) -> str | None:
    """The self-test's verdict; an error (the kernel's first compile, say) is one more objection."""
    try:
        return env.self_test(reducer)
    except Exception as exc:  # noqa: BLE001 - agreed on, then NCCL serves
        return f"self-test failed: {type(exc).__name__}: {exc}"


def _local_refusal(mode: str, world: int, device: torch.device, env: PeerEnv | None) -> str | None:
    """Why this rank cannot take the peer path, from what it knows alone (None: it can)."""
    if mode == "nccl":
        return "engine.tp_allreduce is nccl"
    if env is None:
        return f"device {device.type}: the peer path needs CUDA GPUs"
    refusal = env.refusal()
    if refusal is None and world > max_ranks():
        return f"tp_size {world} is above the peer path's {max_ranks()} ranks"
    return refusal


def _objection(answers: list) -> str | None:
    """The first rank's objection (`rank r: why`), or None when no rank objects."""
    return next((f"rank {r}: {why}" for r, why in enumerate(answers) if why), None)


def _agree(group: AgreeingGroup, why: str | None, what: str) -> str | None:
    """Every rank's answer to one question (one collective): the first objection, or None."""
    return _objection(group.gather(why, f"peer all-reduce: {what}"))


def _torch(objection: str) -> AllReduceChoice:
    choice = AllReduceChoice("torch", objection)
    log.info("tp all-reduce: torch.distributed for every message: %s", objection)
    return choice


class CudaPeers:
    """The peer path on CUDA GPUs: peer access between the ranks' GPUs (or the same GPU), blocks
    shared through CUDA IPC, a self-test against known sums."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sharing: BlockSharing = CudaIpcSharing(device)

    def refusal(self) -> str | None:
        if not triton_available():
            return "the triton package is not installed"
        major, minor = torch.cuda.get_device_capability(self.device)
        if major < 7:
            return f"sm_{major}{minor} has no system-scope acquire/release (needs sm_70 or newer)"
        return None

    def identity(self) -> str:
        return str(torch.cuda.get_device_properties(self.device).uuid)

    def unreachable(self, identity: str) -> str | None:
        """Why this rank cannot read a peer's GPU memory (None: it can, or it is this GPU)."""
        visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
        if identity not in visible:
            return f"a peer's GPU ({identity}) is not visible to this rank"
        peer = visible[identity]
        if peer == self.device.index or torch.cuda.can_device_access_peer(self.device, peer):
            return None
        return f"cuda:{self.device.index} has no peer access to cuda:{peer}"

    def self_test(self, reducer: PeerAllReduce) -> str | None:
        return sums_right(reducer)


def sums_right(reducer: PeerAllReduce, calls: int = 2, n: int = 4096) -> str | None:
    """Sum known fp32 messages (both halves of the blocks in turn); what was wrong, or None."""
    rank, world = reducer.launch.rank, reducer.launch.world
    pattern = torch.arange(n, device=reducer.device, dtype=torch.float32) % 7 + 1
    for call in range(calls):
        x = pattern * (rank + 1 + call)
        reducer(x)
        want = pattern * sum(r + 1 + call for r in range(world))
        right = torch.equal(x, want)  # waits for the launch
        try:
            reducer.check()
        except PeerAllReduceStalled as exc:
            return f"self-test: {exc}"
        if not right:
            bad = int((x != want).sum())
            return f"self-test call {call + 1}: {bad} of {n} sums wrong"
    return None
