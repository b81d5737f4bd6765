"""Warm-up and profiling: no [tokens x vocab] buffer outside sampling rows, a caught OOM leaves no
state behind, and under TP every rank agrees on the KV size and fails together (no hang)."""

from __future__ import annotations

import pytest
import torch
from omnistage.common.config import config_from_dict
from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.engine.llm_engine import LLMEngine
from omnistage.services.thinker.engine.sequence import SamplingParams
from omnistage.services.thinker.group.kv_profile import KVSettings, size_kv_cache
from omnistage.services.thinker.group.startup import RankConfig, start_rank
from omnistage.services.thinker.group.warmup import (
    WarmupError,
    dummy_plan,
    minimal_warmup_shapes,
    run_warmup,
    warmup_shapes,
)
from omnistage.services.thinker.models.tokenizer import MingTokenizer
from omnistage.services.thinker.tp.distributed import TPControl

from tests.services.thinker.group.profile_helpers import (
    CFG,
    AllocationRecorder,
    MiB,
    metered_runner,
    run_ranks,
)

SOLO = TPControl()


def test_dummy_runs_never_build_logits_for_rows_that_do_not_sample(tiny_ckpt):
    mem = SimulatedDeviceMemory(200 * MiB)
    runner = metered_runner(tiny_ckpt, mem)
    vocab = runner.model.config.vocab_size
    rec = AllocationRecorder()
    with mem.meter(), rec:
        size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=200 * MiB, canary_bytes=MiB))
        run_warmup(runner, SOLO, warmup_shapes(runner.cfg), mem=mem)
    max_rows = CFG.max_num_seqs
    vocab_sized = [(shape, dt) for shape, dt in rec.tensors if len(shape) >= 1 and shape[-1] >= vocab]
    assert any(len(s) == 2 and s[0] == max_rows for s, _ in vocab_sized), "the sampler stress never ran"
    too_many_rows = [(s, dt) for s, dt in vocab_sized if len(s) >= 2 and s[0] > max_rows]
    assert not too_many_rows, f"[tokens x vocab] buffers outside sampling rows: {too_many_rows[:5]}"
    # The prefill stress (64 tokens) really ran and really had more rows than sampling rows.
    assert any(len(s) == 2 and s[0] == CFG.max_num_batched_tokens for s, _ in rec.tensors)


def test_dummy_plans_sample_only_where_asked():
    shapes = {s.name: s for s in warmup_shapes(_resolved())}
    prefill, decode = list(shapes.values())[:2]
    assert dummy_plan(prefill, 16).sample_rows.numel() == 0
    plan = dummy_plan(decode, 16)
    assert plan.sample_rows.tolist() == list(range(decode.num_seqs))
    assert plan.num_tokens == decode.num_seqs and int(plan.context_lens.max()) == CFG.max_model_len


def _resolved():
    from omnistage.services.thinker.engine.config import resolve_engine_config

    return resolve_engine_config(CFG)


def test_a_caught_warmup_oom_leaves_no_state_behind(tiny_ckpt):
    mem = SimulatedDeviceMemory(200 * MiB)
    runner = metered_runner(tiny_ckpt, mem)
    with mem.meter():
        size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=200 * MiB, canary_bytes=MiB))
        allocated = mem.allocated()
        shapes = warmup_shapes(runner.cfg)
        current: list[str] = []

        def oom_in_the_second_shape(module, args):  # half-way through its layers
            if current[-1] == shapes[1].name:
                raise torch.OutOfMemoryError("injected out of memory (test)")

        layers = runner.model.attention_layers()
        hook = layers[len(layers) // 2].register_forward_pre_hook(oom_in_the_second_shape)
        with pytest.raises(WarmupError, match=f"rank 0 failed in warm-up shape '{shapes[1].name}'"):
            run_warmup(runner, SOLO, shapes, mem=mem, progress=lambda detail, *_: current.append(detail))
        hook.remove()
        assert mem.allocated() == allocated  # every activation of the failed step was released
        result = run_warmup(runner, SOLO, shapes, mem=mem)  # attention metadata etc. were reset
    assert result.ran == [s.name for s in shapes]
    tok = MingTokenizer(tiny_ckpt)
    engine = LLMEngine(runner, tok, list(tok.stop_token_ids))
    (out,) = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out.token_ids) == 3 and engine.scheduler.block_manager.num_free_blocks == runner.num_kv_blocks


def test_a_shape_one_rank_cannot_run_is_skipped(tiny_ckpt):
    mem = SimulatedDeviceMemory(200 * MiB)
    runner = metered_runner(tiny_ckpt, mem)
    with mem.meter():
        prof = size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=200 * MiB, canary_bytes=MiB))
        shapes = warmup_shapes(runner.cfg)
        need = {s.name: prof.shape_peaks.get(s.name, 1) for s in shapes}
        need[shapes[0].name] = 10 * prof.cap_bytes  # more than this rank has left
        result = run_warmup(runner, SOLO, shapes, mem=mem, cap_bytes=prof.cap_bytes, need_bytes=need)
    assert result.skipped == [shapes[0].name] and result.ran == [s.name for s in shapes[1:]]


def test_tp2_ranks_agree_on_the_smallest_kv_size(tiny_ckpt, tmp_path):
    """The agreement is the KV profile's (the warm-up after it is skipped). Each rank's start-up on a
    simulated device imports none of torch's compiler stack (the meter's dispatch and the model's
    materialisation used to: ~3 s of CPU per rank)."""
    results, _, _ = run_ranks(tiny_ckpt, tmp_path, peer_bytes={"1": 40 * MiB}, warmup=False)
    r0, r1 = results[0], results[1]
    assert r0["status"] == r1["status"] == "ok", (r0, r1)
    assert r0["compiler_modules"] == r1["compiler_modules"] == [], (r0, r1)
    assert r0["cap"] == 200 * MiB and r1["cap"] == 160 * MiB
    assert r0["proposed"] > r1["proposed"]  # rank 0 alone would have taken more ...
    assert r0["blocks"] == r1["blocks"] == r1["proposed"]  # ... both built rank 1's size


def test_a_plain_cpu_rank_warms_up_with_one_small_prompt_one_decode_and_the_timed_decodes(tiny_ckpt):
    """No prefill stress, no larger prompt; the full batch's decode at a KV block and at max_model_len
    still run (after the first decode), so Describe's decode_step_times is there on a plain CPU too."""
    started = start_rank(RankConfig(str(tiny_ckpt), CFG, full_warmup=False))
    assert started.warmup is not None and started.warmup.skipped == []
    assert started.warmup.ran == [
        "prompt 64 tokens",
        "decode 1 seq @ ctx 1 block",
        "decode 4 seqs @ ctx 16",
        "decode 4 seqs @ ctx 512",
    ]
    assert [s.name for s in minimal_warmup_shapes(started.runner.cfg)] == started.warmup.ran
    assert all(s.sample for s in minimal_warmup_shapes(started.runner.cfg))  # the sampler runs in each
    steps = [(t.sequences, t.context_tokens) for t in started.decode_steps]
    assert steps == [(4, 16), (4, 512)] and all(t.seconds > 0 for t in started.decode_steps)
    started.control.close()


@pytest.mark.parametrize(
    ("service", "startup", "full"),
    [
        ({}, {}, False),
        ({}, {"cpu_warmup": "full"}, True),
        ({"memory": {"simulated_capacity_bytes": 1 << 30}}, {}, True),
        ({"device": "cuda", "gpus": [0]}, {}, True),
    ],
    ids=["plain-cpu", "cpu-asks-full", "simulated-device", "cuda"],
)
def test_the_service_ranks_warm_up_fully_wherever_there_is_something_to_build_or_prove(
    service, startup, full
):
    cfg = config_from_dict(
        {"startup": startup, "services": {"thinker": {"kind": "thinker", "port": 7161, **service}}}
    )
    assert RankConfig.from_deploy(cfg, cfg.services["thinker"], 0).full_warmup is full
