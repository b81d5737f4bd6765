"""KV auto-profile on a simulated device: the real tiny thinker's allocations are metered, so the
peak, the target, the teardown check, the canary, the 5 % shrink and the knob diagnostic all run
through the same code a GPU runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from omnistage.common.config import EngineConfig, MemoryConfig
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.kv_profile import KVProfileError, KVSettings, size_kv_cache
from omnistage.services.thinker.group.startup import RankConfig, start_rank
from omnistage.services.thinker.group.warmup import run_dummy_step, stress_shapes
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.services.thinker.tp.distributed import TPControl

from tests.services.thinker.group.profile_helpers import CFG, MiB, metered_runner

SOLO = TPControl()
CAPACITY = 200 * MiB


def profile(
    ckpt, capacity=CAPACITY, budget=0, progress=None, cfg: EngineConfig = CFG, runner=None, mem=None, **kw
):
    mem = mem or SimulatedDeviceMemory(capacity)
    runner = runner or metered_runner(ckpt, mem, cfg)
    settings = KVSettings(budget_bytes=budget or capacity, canary_bytes=cfg.kv_canary_bytes, **kw)
    with mem.meter():
        prof = size_kv_cache(runner, SOLO, mem, settings, progress=progress)
    return runner, mem, prof


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):
    """The undisturbed profile on the whole simulated device (runner, mem, profile)."""
    return profile(tiny_ckpt)


def test_profile_fills_the_budget_and_max_load_fits(baseline):
    runner, mem, prof = baseline
    assert runner.num_kv_blocks == prof.num_blocks > 2 * -(-CFG.max_model_len // CFG.block_size)
    assert runner.kv_bytes() == prof.num_blocks * runner.kv_block_bytes()
    assert 0 <= prof.peak_reserved_bytes <= prof.cap_bytes == CAPACITY
    # Most of the budget went to the cache: what is left is the measured activations plus the canary
    # and the segment a peak may round up to.
    unused = CAPACITY - prof.weights_bytes - prof.kv_bytes
    assert unused <= prof.activation_peak_bytes + CFG.kv_canary_bytes + mem.segment_bytes + 3 * MiB
    report = runner.memory_report()
    assert report.kv_cache_bytes == prof.kv_bytes and report.budget_bytes == CAPACITY
    assert report.activation_peak_bytes == prof.activation_peak_bytes > 0
    assert report.weights_bytes == prof.weights_bytes
    # The sizes it chose really serve the largest steps (sampler included) within the device.
    with mem.meter():
        for shape in stress_shapes(runner.cfg):
            run_dummy_step(runner, shape)
    assert mem.peak_reserved() <= CAPACITY


def test_more_budget_buys_proportionally_more_kv(tiny_ckpt, baseline):
    _, _, small = profile(tiny_ckpt, budget=140 * MiB)
    extra_blocks = baseline[2].num_blocks - small.num_blocks
    assert small.cap_bytes == 140 * MiB
    assert abs(extra_blocks * small.block_bytes - 60 * MiB) <= 4 * MiB


def test_peers_on_the_device_shrink_the_cache(tiny_ckpt, baseline):
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    peer = mem.reserve(50 * MiB, "other stage")
    with mem.meter():
        prof = size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=CAPACITY, canary_bytes=MiB))
    assert prof.peers_bytes == 50 * MiB and prof.cap_bytes == CAPACITY - 50 * MiB
    alone = baseline[2]
    assert abs((alone.num_blocks - prof.num_blocks) * prof.block_bytes - 50 * MiB) <= 4 * MiB
    peer.release()


def test_pinned_kv_tokens_skip_the_search_but_are_validated(tiny_ckpt):
    steps = []
    runner, _, prof = profile(tiny_ckpt, pinned_tokens=1000, progress=lambda d, *_: steps.append(d))
    assert prof.pinned and prof.num_blocks == runner.num_kv_blocks == 63  # ceil(1000 / 16)
    assert not any(s.startswith("probe") for s in steps)
    assert any(s.startswith("validate") for s in steps)
    with pytest.raises(KVProfileError, match="pinned KV size does not fit"):
        profile(tiny_ckpt, pinned_tokens=1400 * 16)


def test_an_oom_in_validation_shrinks_5_percent_and_retries(tiny_ckpt, baseline):
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    held = []

    def progress(detail, done, total):
        if detail.startswith("validate") and done == 1:  # a peer grows between rebuild and validation
            held.append(mem.reserve(8 * MiB, "peer grew"))  # more than the proposal's segment of room

    with mem.meter():
        prof = size_kv_cache(
            runner, SOLO, mem, KVSettings(budget_bytes=CAPACITY, canary_bytes=MiB), progress=progress
        )
    assert prof.attempts == 2 and held
    assert prof.num_blocks == int(baseline[2].num_blocks * 0.95)


def test_the_first_proposal_leaves_the_peak_it_is_then_checked_against(tiny_ckpt):
    """A first forward that keeps an allocation for good (on CUDA: cuBLAS's workspace) is part of the
    first stress step's measured peak; the proposal used to ignore it, and attempt 1 failed its own
    check before validation ("2.23 GiB left in the budget, the largest stress step needs 2.23 GiB")
    on every full-shape start-up. The first proposal must fit."""
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    workspace: list[torch.Tensor] = []

    def keep_a_workspace(module, args):
        if not workspace:
            workspace.append(torch.empty(8 * MiB, dtype=torch.uint8))

    runner.model.register_forward_pre_hook(keep_a_workspace)
    steps: list[str] = []
    _, _, prof = profile(tiny_ckpt, runner=runner, mem=mem, progress=lambda detail, *_: steps.append(detail))
    assert workspace and prof.attempts == 1, steps
    # ... and it still takes what there is: what is left is the largest step plus canary and rounding.
    unused = CAPACITY - mem.allocated()
    assert unused <= prof.activation_peak_bytes + MiB + mem.segment_bytes + 3 * MiB


def test_memory_held_outside_the_allocator_during_the_probe_shrinks_the_cap(tiny_ckpt):
    """NCCL's buffers and the CUDA context grow with the first forwards, outside our allocator (~1.5 GiB
    per rank on an H200 at TP=2). Measured before them, the cap promised memory the device no longer
    had (without a budget: a device OOM inside a TP forward in the validation). Re-measured after the
    probe stress, the first proposal fits."""
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    held = []

    def lazily_held(module, args):
        if not held:
            held.append(mem.reserve(12 * MiB, "communicator buffers"))

    runner.model.register_forward_pre_hook(lazily_held)
    steps: list[str] = []
    _, _, prof = profile(tiny_ckpt, runner=runner, mem=mem, progress=lambda detail, *_: steps.append(detail))
    assert held and prof.attempts == 1, steps
    assert prof.cap_bytes == CAPACITY - 12 * MiB and prof.peers_bytes == 12 * MiB


def test_gives_up_after_its_attempts_naming_every_knob(tiny_ckpt):
    """The service makes 4 attempts (the default); 2 show the retry and the giving up at half the cost."""
    assert KVSettings.from_config(CFG, MemoryConfig(), CAPACITY).max_attempts == 4
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    attempts = []

    def progress(detail, done, total):
        if detail.startswith("validate"):  # a peer that keeps growing: every validation OOMs
            attempts.append(detail)
            mem.reserve(mem.free() - 64 * 1024, "greedy peer")

    settings = KVSettings(budget_bytes=CAPACITY, canary_bytes=MiB, max_attempts=2)
    with mem.meter(), pytest.raises(KVProfileError) as err:
        size_kv_cache(runner, SOLO, mem, settings, progress=progress)
    assert len(attempts) == 2 and "attempt 1/2" in attempts[0] and "attempt 2/2" in attempts[-1]
    msg = str(err.value)
    assert "failed after 2 attempt(s)" in msg
    for knob in (
        "memory.budget_bytes",
        "memory.budget_fraction",
        "engine.max_num_seqs",
        "engine.max_num_batched_tokens",
        "engine.max_model_len",
        "CUDA graph sizes",
        "engine.kv_tokens",
        "engine.kv_safety_factor",
    ):
        assert knob in msg


# 14 MiB over the weights: the probe and its stress fit, the target does not; 6 MiB: not even the stress.
@pytest.mark.parametrize(
    "extra, failure",
    [
        (14 * MiB, "only .* KV blocks fit .* one max_model_len request needs 32"),
        (6 * MiB, "the stress at the probe size does not fit"),
    ],
)
def test_a_budget_below_one_request_fails_before_any_rebuild(tiny_ckpt, extra, failure):
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    with mem.meter(), pytest.raises(KVProfileError, match=failure) as err:
        size_kv_cache(
            runner, SOLO, mem, KVSettings(budget_bytes=mem.allocated() + extra, canary_bytes=8 * MiB)
        )
    assert "engine.kv_tokens" in str(err.value) and "engine.max_model_len=512" in str(err.value)


class LeakyUser:
    """A KV user that ignores release_kv: it pins the probe cache (the LightLLM review's bug)."""

    def __init__(self) -> None:
        self.bound: list[torch.Tensor] = []

    def bind_kv(self, kv_cache: torch.Tensor) -> None:
        self.bound.append(kv_cache[0, 0])

    def release_kv(self) -> None:
        pass


class GoodUser(LeakyUser):
    def release_kv(self) -> None:
        self.bound.clear()


def test_teardown_that_does_not_free_the_probe_fails_clearly(tiny_ckpt):
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    runner.kv_users.append(LeakyUser())
    with mem.meter(), pytest.raises(KVProfileError, match="still references the old cache"):
        size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=CAPACITY, canary_bytes=MiB))


def test_rebuild_rebinds_every_view_and_the_engine_serves_identically(tiny_ckpt):
    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    user = GoodUser()
    runner.kv_users.append(user)
    with mem.meter():
        size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=CAPACITY, canary_bytes=MiB))
    kv = runner.kv_cache
    assert [t.untyped_storage().data_ptr() for t in user.bound] == [kv.untyped_storage().data_ptr()]
    for i, layer in enumerate(runner.model.attention_layers()):
        assert (
            layer.k_cache.data_ptr() == kv[0, i].data_ptr()
            and layer.v_cache.data_ptr() == kv[1, i].data_ptr()
        )
    tok = MingTokenizer(tiny_ckpt)
    prompts = [[5, 6, 7, 8, 9] * 20, [11, 12, 13]]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    profiled = LLMEngine(runner, tok, list(tok.stop_token_ids)).generate(prompts, params)
    legacy = ModelRunner(
        runner.model, resolve_engine_config(dataclasses.replace(CFG, num_kv_blocks=64)), "cpu"
    )
    plain = LLMEngine(legacy, tok, list(tok.stop_token_ids)).generate(prompts, params)
    assert [r.token_ids for r in profiled] == [r.token_ids for r in plain]


def test_cpu_without_a_simulated_device_keeps_the_old_sizing(tiny_ckpt):
    started = start_rank(RankConfig(str(tiny_ckpt), CFG))
    runner = started.runner
    assert started.kv_profile is None and runner.budget_bytes == 0
    assert runner.num_kv_blocks == CFG.max_num_seqs * CFG.max_model_len // CFG.block_size


@pytest.mark.parametrize(("kv_mib", "blamed"), [(8, False), (64, True)])
def test_teardown_blames_a_cache_only_when_it_has_segments_of_its_own(tiny_ckpt, kv_mib, blamed):
    """CUDA's allocator packs a request of 1-10 MiB into a 20 MiB segment shared with other tensors, so
    freeing a small cache may drop nothing (a tiny checkpoint on a GPU): only a larger one is blamed."""
    from omnistage.services.thinker.group.kv_profile import _Profiler

    mem = SimulatedDeviceMemory(CAPACITY)
    runner = metered_runner(tiny_ckpt, mem)
    prof = _Profiler(runner, SOLO, mem, KVSettings(budget_bytes=CAPACITY), 0, None, None)
    runner.free_kv = lambda: None  # the segment stays reserved, as a shared one does
    if blamed:
        with pytest.raises(KVProfileError, match="released 0 B of reserved memory, expected at least 64"):
            prof.teardown(kv_mib * MiB)
    else:
        prof.teardown(kv_mib * MiB)


@pytest.mark.parametrize("segment_mib", [2, 20])
def test_the_first_proposal_fits_whatever_segment_its_peak_rounds_to(tiny_ckpt, segment_mib):
    """Reserved memory grows in segments (CUDA: 2 MiB pages for large blocks, 20 MiB segments shared by
    the 1-10 MiB requests), so the peak at the chosen cache size may round one segment higher than the
    probe's peak did at its small cache. The proposal left no room for that: on one H200 attempt 1
    failed its own check by ~10 MiB ("peak reserved 55.54 GiB leaves less than the canary (391.35 MiB)
    of the budget 55.92 GiB") before the 5 % shrink. The first proposal must fit."""
    mem = SimulatedDeviceMemory(CAPACITY, segment_bytes=segment_mib * MiB)
    runner = metered_runner(tiny_ckpt, mem)
    steps: list[str] = []
    _, _, prof = profile(tiny_ckpt, runner=runner, mem=mem, progress=lambda detail, *_: steps.append(detail))
    assert prof.attempts == 1, steps
    assert prof.peak_reserved_bytes + MiB <= prof.cap_bytes
