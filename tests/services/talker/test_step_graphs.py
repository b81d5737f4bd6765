"""The talker's static-buffer step (`StepGraphs`, what CUDA graphs capture) run without capture on the CPU:
bucket choice, padding and buffers give the eager path's results — per call at every bucket, through
the engine for rows joining and leaving, and with the stochastic term; and nothing past a bucket."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.models.qwen2 import Rows
from omnistage.services.talker.request_flow import TalkerEngine
from omnistage.services.talker.step_graphs import batch_buckets, bucket_of, span_buckets

from tests.services.talker.talker_jobs import run_staggered


def test_buckets_cover_every_batch_up_to_the_cap_and_every_span_up_to_the_cache():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert span_buckets(256) == [64, 128, 256]
    assert span_buckets(300) == [64, 128, 256, 300]
    assert [bucket_of(n, batch_buckets(6)) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
    with pytest.raises(ValueError, match="exceeds"):
        bucket_of(7, batch_buckets(6))


def _runners(models, slots=6, max_len=200, **kw):
    eager = TalkerRunner(models, slots, max_len, 64, **kw)
    static = TalkerRunner(models, slots, max_len, 64, graphs=True, capture=False, **kw)
    return eager, static


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_static_decode_and_sample_equal_eager_at_every_bucket(talker_models, temperature):
    eager, static = _runners(talker_models, temperature=temperature)
    cfg = talker_models.config
    hidden = cfg.llm.hidden_size
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randn(9, hidden, generator=gen)
    for slot in range(6):  # the same prompts in both caches, rows at different positions
        for r in (eager, static):
            r.prefill(slot, prompt[: 3 + slot])
    for n in (1, 2, 3, 5, 6):  # buckets 1, 2, 4 (padded), 6 (padded), 6
        slots = list(range(n))
        positions = [3 + s for s in slots]
        x = torch.randn(n, hidden, generator=gen)
        want_h = eager.decode(slots, positions, x)
        got_h = static.decode(slots, positions, x)
        torch.testing.assert_close(got_h, want_h, atol=1e-5, rtol=1e-5)
        history = torch.randn(n, cfg.history_patch_size, cfg.latent_dim, generator=gen)
        want = eager.sample(want_h, history, [torch.Generator().manual_seed(10 + i) for i in range(n)])
        got = static.sample(want_h, history, [torch.Generator().manual_seed(10 + i) for i in range(n)])
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert static.static is not None and static.static.replays == 10 and static.static.graphs == 0
    for slot in range(6):  # both caches hold the same keys: padded rows only ever wrote the scratch slot
        for layer in range(cfg.llm.num_layers):
            torch.testing.assert_close(
                static.lm_cache.k[layer][slot], eager.lm_cache.k[layer][slot], atol=1e-6, rtol=1e-5
            )


def test_static_outputs_are_copies_that_the_next_step_does_not_overwrite(talker_models):
    _, static = _runners(talker_models)
    cfg = talker_models.config
    h = torch.randn(2, cfg.llm.hidden_size)
    hist = torch.zeros(2, cfg.history_patch_size, cfg.latent_dim)
    first = static.sample(h, hist, [torch.Generator().manual_seed(i) for i in range(2)])
    kept = [t.clone() for t in first]
    static.sample(h * 2, hist + 1, [torch.Generator().manual_seed(9 + i) for i in range(2)])
    for a, b in zip(first, kept, strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_engine_speaks_the_same_audio_with_static_steps(talker_models, voices):
    """Rows join at different steps and leave early: padded buckets change from step to step."""
    specs = [
        dict(text="Hello there, my friend.", seed=3, max_steps=5),
        dict(text="一个完全不同的句子。", seed=4, max_steps=7, voice="lingguang"),
        dict(text="Short.", seed=5, max_steps=3),
    ]
    audio = []
    for graphs in (False, True):
        widths = (64, 128, 256) if graphs else ()  # the new prompts' prefill on the buffers too
        engine = TalkerEngine(
            TalkerRunner(talker_models, 3, 256, 640, graphs=graphs, capture=False, prefill_widths=widths)
        )
        recs = run_staggered(engine, talker_models, voices, specs)
        audio.append([r.audio for r in recs])
        if graphs:
            assert engine.runner.model.static.replays > 0
    for got, want in zip(audio[1], audio[0], strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-3)


def test_the_vae_backbone_at_padded_widths_equals_eager(talker_models):
    """Rows of different lengths (a first step's 14 frames, a last step's 18) padded to the width buckets
    16 and 32: real rows equal the eager stack's and the real slots' caches hold the same keys."""
    eager, static = _runners(talker_models, slots=3)
    stack = talker_models.vae.decoder.decoder
    hidden = stack.shape.hidden_size
    gen = torch.Generator().manual_seed(2)
    for slots, starts, lengths in (
        ([0, 1, 2], [0, 0, 0], [14, 14, 14]),
        ([0, 2], [14, 14], [16, 18]),
        ([1], [14], [3]),
    ):
        width = max(lengths)
        x = torch.randn(len(slots), width, hidden, generator=gen)
        with torch.no_grad():
            want = stack(x, eager.vae_cache, Rows.of(slots, starts, lengths, "cpu"))
        got = static.static.vae_backbone(x, slots, starts, lengths)
        for i, n in enumerate(lengths):
            torch.testing.assert_close(got[i, :n], want[i, :n], atol=1e-5, rtol=1e-5)
    for layer in range(stack.shape.num_layers):
        torch.testing.assert_close(
            static.vae_cache.k[layer][:3], eager.vae_cache.k[layer][:3], atol=1e-6, rtol=1e-5
        )
    assert static.static.replays == 3


def test_prompts_prefilled_on_the_padded_buffers_equal_eager_and_longer_ones_stay_eager(talker_models):
    """New segments' prompts at the prefill widths asked for (rows and tokens padded up, span = width):
    each prompt's last hidden state and its slot's keys as the eager prefill; a prompt past the widest
    bucket is prefilled eagerly."""
    eager, static = _runners(talker_models, slots=6, prefill_widths=(8, 16))
    hidden = talker_models.config.llm.hidden_size
    gen = torch.Generator().manual_seed(7)
    assert static.static is not None and static.static.prefills.keys() == [
        (b, w, w) for b in (6, 4, 2, 1) for w in (16, 8)
    ]
    for lengths, slots in (((7, 12, 3), [0, 1, 2]), ((5,), [3]), ((16, 9), [4, 5])):
        prompts = [torch.randn(n, hidden, generator=gen) for n in lengths]
        replays = static.static.replays
        want = eager.prefill_batch(slots, prompts)
        got = static.prefill_batch(slots, prompts)
        assert static.static.replays == replays + 1  # one padded run for all of them
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer in range(talker_models.config.llm.num_layers):
        torch.testing.assert_close(
            static.lm_cache.k[layer][:6], eager.lm_cache.k[layer][:6], atol=1e-6, rtol=1e-5
        )
    replays = static.static.replays
    long = [torch.randn(17, hidden, generator=gen)]
    torch.testing.assert_close(
        static.prefill_batch([0], long), eager.prefill_batch([0], long), atol=1e-5, rtol=1e-5
    )
    assert static.static.replays == replays  # past the widest bucket: eager


def _failed_capture(first: BaseException) -> RuntimeError:
    """capture_end's error raised while handling the first one (how a failed capture surfaces)."""
    try:
        try:
            raise first
        except BaseException:
            raise RuntimeError(
                "CUDA error: operation failed due to a previous error during capture"
            ) from None
    except RuntimeError as exc:
        exc.__context__ = first
        return exc


@pytest.mark.parametrize(
    ("first", "free", "kind", "says"),
    [
        (
            torch.OutOfMemoryError("CUDA out of memory"),
            50 << 30,
            torch.OutOfMemoryError,
            "step-graph capture",
        ),
        (
            RuntimeError("CUDA error: operation not permitted when stream is capturing"),
            300 << 20,
            RuntimeError,
            "talker step-graph capture failed (device 300.00 MiB free",
        ),
        (
            RuntimeError("CUDA error: operation not permitted when stream is capturing"),
            50 << 30,
            RuntimeError,
            "talker step-graph capture failed (device 50.00 GiB free",
        ),
    ],
)
def test_a_failed_capture_stays_an_oom_when_it_was_one_and_names_the_memory_otherwise(
    monkeypatch, first, free, kind, says
):
    from omnistage.services.talker.step_graphs import _capture_error

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 4 << 30)
    err = _capture_error(_failed_capture(first), torch.device("cuda", 0))
    assert type(err) is kind and says in str(err)
