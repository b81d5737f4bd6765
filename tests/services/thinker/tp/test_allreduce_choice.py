"""Which all-reduce the TP group runs: every rank takes the same path after the same collectives,
the peer path only when no rank objects in any round (what it knows alone, peer access, opening the
blocks, the self-test), with the objecting rank and its reason in every rank's choice. A world of
ranks runs as threads whose `gather` is a barrier; the device is a fake (CPU tensors as blocks)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
import torch
from omnistage.services.thinker.tp import allreduce_choice
from omnistage.services.thinker.tp.allreduce_choice import AllReduceChoice, choose_all_reduce

TIMEOUT_S = 42.0


class ThreadWorld:
    """N ranks in threads; `gather` hands every rank every value once all have called it (with the
    same `what`, recorded per rank)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.values: list = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)
        self.collectives: dict[int, list[str]] = {r: [] for r in range(world)}

    def group(self, rank: int) -> _Rank:
        return _Rank(self, rank)

    def run(self, fn) -> list:
        results: list = [None] * self.world
        errors: list = []

        def one(rank: int) -> None:
            try:
                results[rank] = fn(self.group(rank))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        return results


@dataclass
class _Rank:
    world_: ThreadWorld
    rank: int

    @property
    def world_size(self) -> int:
        return self.world_.world

    def gather(self, value: object, what: str) -> list:
        w = self.world_
        w.collectives[self.rank].append(what)
        w.values[self.rank] = value
        w.barrier.wait()
        out = list(w.values)
        w.barrier.wait()
        return out


class SharedBlocks:
    """Blocks as CPU tensors of one process: the export is a key, opening looks it up."""

    def __init__(self, fail_open_on: set[int] = frozenset()) -> None:
        self.blocks: dict[int, torch.Tensor] = {}
        self.fail_open_on = fail_open_on
        self.lock = threading.Lock()

    def for_rank(self, rank: int) -> _Sharing:
        return _Sharing(self, rank)


@dataclass
class _Sharing:
    shared: SharedBlocks
    rank: int

    def allocate(self, nbytes: int) -> torch.Tensor:
        raw = torch.zeros(nbytes + 256, dtype=torch.uint8)
        skip = -raw.data_ptr() % 256  # aligned as the CUDA allocator's blocks are
        return raw[skip : skip + nbytes]

    def export(self, block: torch.Tensor) -> object:
        with self.shared.lock:
            self.shared.blocks[self.rank] = block
        return self.rank

    def open(self, handle: object) -> torch.Tensor:
        if self.rank in self.shared.fail_open_on:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid argument")
        return self.shared.blocks[handle]  # type: ignore[index]


@dataclass
class FakeEnv:
    """A rank's device as the choice sees it; each answer scripted."""

    rank: int
    sharing: _Sharing
    refuse: str | None = None
    unreachable_ids: set[str] = field(default_factory=set)
    test_result: str | None = None
    device: torch.device = torch.device("cpu")
    tested: list = field(default_factory=list)

    def refusal(self) -> str | None:
        return self.refuse

    def identity(self) -> str:
        return f"GPU-{self.rank}"

    def unreachable(self, identity: str) -> str | None:
        return f"no peer access to {identity}" if identity in self.unreachable_ids else None

    def self_test(self, reducer) -> str | None:
        self.tested.append(reducer)
        if self.test_result == "raise":
            raise RuntimeError("PassManager::run failed")
        return self.test_result


def choose(world: int, mode: str = "auto", *, shared: SharedBlocks | None = None, **per_rank) -> tuple:
    """Every rank's choice and the envs; `per_rank`: FakeEnv field -> {rank: value}."""
    tw, shared = ThreadWorld(world), shared or SharedBlocks()
    envs = [FakeEnv(r, shared.for_rank(r)) for r in range(world)]
    for name, values in per_rank.items():
        for rank, value in values.items():
            setattr(envs[rank], name, value)
    choices = tw.run(lambda g: choose_all_reduce(g, mode, torch.device("cpu"), TIMEOUT_S, envs[g.rank]))
    return choices, envs, tw


def assert_same_everywhere(choices: list[AllReduceChoice], tw: ThreadWorld) -> None:
    assert len({(c.path, c.reason) for c in choices}) == 1, choices
    assert all(tw.collectives[r] == tw.collectives[0] for r in tw.collectives), tw.collectives


def test_every_rank_takes_the_peer_path_when_none_objects():
    choices, envs, tw = choose(3)
    assert_same_everywhere(choices, tw)
    assert [c.path for c in choices] == ["peer"] * 3
    assert tw.collectives[0] == [
        "peer all-reduce: devices",
        "peer all-reduce: peer access",
        "peer all-reduce: exchanging blocks",
        "peer all-reduce: blocks",
        "peer all-reduce: self-test",
    ]
    for rank, choice in enumerate(choices):
        reducer = choice.reducer
        assert reducer is not None and not reducer.blocks.closed
        assert reducer.timeout_s == TIMEOUT_S  # the self-test's deadline replaced by start-up's
        assert reducer.launch.rank == rank and reducer.launch.world == 3
        # Every rank addresses the same blocks, in rank order.
        assert reducer.blocks.addresses == choices[0].reducer.blocks.addresses
        assert envs[rank].tested == [reducer]


@pytest.mark.parametrize(
    ("scripted", "objection"),
    [
        (
            {"refuse": {1: "the triton package is not installed"}},
            "rank 1: the triton package is not installed",
        ),
        ({"unreachable_ids": {0: {"GPU-2"}}}, "rank 0: no peer access to GPU-2"),
        ({"test_result": {2: "self-test call 1: 7 of 4096 sums wrong"}}, "rank 2: self-test call 1: 7"),
        ({"test_result": {1: "raise"}}, "rank 1: self-test failed: RuntimeError: PassManager::run failed"),
    ],
    ids=["alone", "peer-access", "self-test", "self-test-raises"],
)
def test_one_rank_objecting_sends_every_rank_to_torch_naming_it(scripted, objection):
    choices, _envs, tw = choose(3, **scripted)
    assert_same_everywhere(choices, tw)
    assert choices[0].path == "torch" and choices[0].reason.startswith(objection)
    assert all(c.reducer is None for c in choices)


def test_a_rank_that_cannot_open_a_peer_block_sends_every_rank_to_torch_and_frees_the_blocks(monkeypatch):
    made = []

    class Recorded(allreduce_choice.PeerAllReduce):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(allreduce_choice, "PeerAllReduce", Recorded)
    choices, envs, tw = choose(2, shared=SharedBlocks(fail_open_on={1}))
    assert_same_everywhere(choices, tw)
    assert choices[0].path == "torch"
    assert choices[0].reason == (
        "rank 1: opening the peer blocks failed: RuntimeError: cudaIpcOpenMemHandle: invalid argument"
    )
    assert len(made) == 1 and made[0].blocks.closed  # rank 0 had opened its blocks: closed again
    assert envs[0].tested == []  # no self-test after the blocks round objected


def test_a_failed_self_test_frees_every_ranks_blocks():
    choices, envs, tw = choose(2, test_result={0: "self-test: rank 0: peer all-reduce call 1 waited 60s"})
    assert_same_everywhere(choices, tw)
    assert choices[1].reason.startswith("rank 0: self-test")
    assert all(env.tested[0].blocks.closed for env in envs)


@pytest.mark.parametrize(
    ("mode", "device", "world", "reason"),
    [
        ("nccl", "cpu", 2, "rank 0: engine.tp_allreduce is nccl"),
        ("auto", "cpu", 2, "rank 0: device cpu: the peer path needs CUDA GPUs"),
    ],
)
def test_what_a_rank_knows_alone_decides_in_one_collective(mode, device, world, reason):
    tw = ThreadWorld(world)
    choices = tw.run(lambda g: choose_all_reduce(g, mode, torch.device(device), TIMEOUT_S))
    assert_same_everywhere(choices, tw)
    assert (choices[0].path, choices[0].reason) == ("torch", reason)
    assert tw.collectives[0] == ["peer all-reduce: devices"]


def test_more_ranks_than_the_kernel_serves_refuse():
    choices, _envs, tw = choose(9)
    assert_same_everywhere(choices, tw)
    assert choices[0].reason == "rank 0: tp_size 9 is above the peer path's 8 ranks"


def test_one_rank_sums_nothing_and_runs_no_collective():
    tw = ThreadWorld(1)
    (choice,) = tw.run(lambda g: choose_all_reduce(g, "auto", torch.device("cuda:0"), TIMEOUT_S))
    assert choice.path == "local" and tw.collectives[0] == []


# --- the CUDA device's answers (torch.cuda faked: CI has no GPU) -------------------------------


@dataclass
class _Props:
    uuid: str


@pytest.fixture
def two_gpus(monkeypatch):
    """cuda:0 and cuda:1 visible; `access` holds the (from, to) pairs with peer access."""
    access: set[tuple[int, int]] = {(0, 1), (1, 0)}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: _Props(f"GPU-{_index(d)}"))
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda a, b: (_index(a), _index(b)) in access)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (9, 0))
    return access


def _index(d) -> int:
    return d.index if isinstance(d, torch.device) else int(d)


def test_a_gpu_reaches_a_peer_gpu_with_peer_access_and_its_own_gpu(two_gpus):
    peers = allreduce_choice.CudaPeers(torch.device("cuda:0"))
    assert peers.refusal() is None and peers.identity() == "GPU-0"
    assert peers.unreachable("GPU-1") is None
    assert peers.unreachable("GPU-0") is None  # two ranks on one GPU: IPC within the device
    two_gpus.clear()
    assert peers.unreachable("GPU-1") == "cuda:0 has no peer access to cuda:1"
    assert peers.unreachable("GPU-7") == "a peer's GPU (GPU-7) is not visible to this rank"


def test_a_gpu_without_triton_or_too_old_refuses(two_gpus, monkeypatch):
    peers = allreduce_choice.CudaPeers(torch.device("cuda:1"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: (6, 1))
    assert peers.refusal() == "sm_61 has no system-scope acquire/release (needs sm_70 or newer)"
    monkeypatch.setattr(allreduce_choice, "triton_available", lambda: False)
    assert peers.refusal() == "the triton package is not installed"


@dataclass
class _Launch:
    rank: int
    world: int


class _Summing:
    """A reducer that sums like a group of `world` ranks sending the self-test's messages would."""

    def __init__(self, rank: int, world: int, broken: bool = False, stalled: Exception | None = None):
        self.launch, self.device = _Launch(rank, world), torch.device("cpu")
        self.broken, self.stalled, self.calls = broken, stalled, 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.broken:  # x = pattern * own: times the ranks' total over own, exact in fp32
            x.mul_(sum(r + 1 + self.calls for r in range(self.launch.world)))
            x.div_(self.launch.rank + 1 + self.calls)
        self.calls += 1
        return x

    def check(self) -> None:
        if self.stalled is not None:
            raise self.stalled


def test_the_self_test_checks_every_sum_and_names_a_stall():
    assert allreduce_choice.sums_right(_Summing(1, 2)) is None
    assert (
        allreduce_choice.sums_right(_Summing(1, 2, broken=True))
        == "self-test call 1: 4096 of 4096 sums wrong"
    )
    stall = allreduce_choice.PeerAllReduceStalled(1, 0, 1, 60.0)
    assert allreduce_choice.sums_right(_Summing(1, 2, stalled=stall)) == (
        "self-test: rank 1: peer all-reduce call 1 waited 60s for rank 0, which never reached it"
    )
