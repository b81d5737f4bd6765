"""The thinker's decode step at the full batch, timed by the warm-up at a KV block of context and at
max_model_len (group/decode_pace.py): what its Describe tells the gateway of a step's growth."""

from __future__ import annotations

from omnistage.common.memory.device import SimulatedDeviceMemory
from omnistage.services.thinker.engine.config import resolve_engine_config
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.group.decode_pace import decode_step_times
from omnistage.services.thinker.group.kv_profile import KVSettings, size_kv_cache
from omnistage.services.thinker.group.warmup import (
    DummyShape,
    WarmupResult,
    decode_short_shape,
    decode_stress_shape,
    run_warmup,
    warmup_shapes,
)
from omnistage.services.thinker.tp.distributed import TPControl

from tests.services.thinker.group.profile_helpers import CFG, MiB, metered_runner

SOLO = TPControl()


def _warmed(ckpt, need_bytes=None) -> tuple[ModelRunner, list[DummyShape], WarmupResult]:
    """The tiny thinker's KV profile then its full warm-up on a simulated device; `need_bytes(runner,
    shapes, profile)`: each shape's stated need (None: the profile's)."""
    mem = SimulatedDeviceMemory(200 * MiB)
    runner = metered_runner(ckpt, mem)
    with mem.meter():
        prof = size_kv_cache(runner, SOLO, mem, KVSettings(budget_bytes=200 * MiB, canary_bytes=MiB))
        shapes = warmup_shapes(runner.cfg)
        need = need_bytes(runner, shapes, prof) if need_bytes else None
        result = run_warmup(runner, SOLO, shapes, mem=mem, cap_bytes=prof.cap_bytes, need_bytes=need)
    return runner, shapes, result


def test_the_warm_up_times_the_full_batch_decode_at_a_kv_block_and_at_max_model_len(tiny_ckpt):
    runner, shapes, result = _warmed(tiny_ckpt)
    short, long = decode_short_shape(runner.cfg), decode_stress_shape(runner.cfg)
    assert (short.name, long.name) == ("decode 4 seqs @ ctx 16", "decode 4 seqs @ ctx 512")
    assert set(result.shape_s) == {s.name for s in shapes} and all(t > 0 for t in result.shape_s.values())
    times = decode_step_times(runner.cfg, result)
    assert [(t.sequences, t.context_tokens) for t in times] == [(4, 16), (4, 512)]
    assert [t.seconds for t in times] == [result.shape_s[short.name], result.shape_s[long.name]]
    proto = times[1].to_proto()  # Describe's Limits.decode_step_times
    assert (proto.sequences, proto.context_tokens, proto.seconds) == (4, 512, times[1].seconds)


def test_a_skipped_shape_leaves_the_steps_untimed(tiny_ckpt):
    """No half measurement: the gateway then prices a step flat, as before it was told."""

    def need(runner, shapes, prof):  # the decode stress needs more than the rank has
        return {s.name: 1 for s in shapes} | {decode_stress_shape(runner.cfg).name: 10 * prof.cap_bytes}

    runner, _, result = _warmed(tiny_ckpt, need)
    assert result.skipped == [decode_stress_shape(runner.cfg).name]
    assert decode_step_times(runner.cfg, result) == []


def test_the_fastest_run_of_a_shape_counts():
    shape = decode_short_shape(resolve_engine_config(CFG))
    result = WarmupResult()
    for seconds in (0.3, 0.1, 0.2):  # a first run builds kernels; a loaded host only ever adds time
        result.timed(shape, seconds)
    assert result.shape_s == {shape.name: 0.1}
