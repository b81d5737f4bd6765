"""A spoken segment's chunks on the tiny checkpoint: the first chunk is all the first talker step made
(one patch's decodable frames, sent after that one step), every step's audio goes out as one chunk,
and the chunks joined are the whole segment's latents decoded at once (the VAE's streaming tolerance)."""

from __future__ import annotations

import asyncio
import concurrent.futures

import numpy as np
import torch
from omnistage.common.config import TalkerConfig
from omnistage.services.talker.model_runner import TalkerRunner
from omnistage.services.talker.request_flow import (
    Chunk,
    Finished,
    SegmentSpoken,
    Started,
    StreamSettings,
    TalkerEngine,
    TextInput,
    pcm16,
)


class RecordingRunner(TalkerRunner):
    """The model runner, recording each VAE step's latents and the samples it gave (one stream)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.latents: list[torch.Tensor] = []
        self.step_samples: list[int] = []

    def vae(self, streams, latents, last):
        out = super().vae(streams, latents, last)
        assert len(streams) == 1
        self.latents.append(latents[0].clone())
        self.step_samples.append(out[0].numel())
        return out


def _speak(engine: TalkerEngine, text: str) -> list:
    async def inputs():
        yield TextInput(text, end_of_text=True)

    async def go():
        settings = StreamSettings(request_id="r1", seed=7)
        return [event async for event in engine.speak(settings, inputs())]

    return asyncio.run(asyncio.wait_for(go(), 120))


def test_the_first_chunk_is_the_first_step_and_the_chunks_are_the_whole_decode(talker_models, voices):
    runner = RecordingRunner(talker_models, 2, 256, 640)
    cfg = TalkerConfig(min_steps=100)  # only the step budget ends the segment: a known length
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        engine = TalkerEngine(runner, voices, cfg, pool)
        engine.start()
        try:
            events = _speak(engine, "Hi there.")
        finally:
            engine.stop()
    assert isinstance(events[0], Started) and isinstance(events[-1], Finished)
    chunks = [e for e in events if isinstance(e, Chunk)]
    (spoken,) = [e for e in events if isinstance(e, SegmentSpoken)]
    steps = runner.step_samples
    assert spoken.steps == len(steps) > 2
    # Chunk boundaries are step boundaries: the first chunk is the first step's audio, all of it.
    vae = talker_models.config.vae
    first_frames = talker_models.config.patch_size * vae.patch_size - vae.patch_size // 2  # 14 of 16
    assert steps[0] == first_frames * vae.dec_hop - (vae.n_fft - vae.dec_hop) // 2  # less the OLA tail
    assert [len(c.pcm16) // 2 for c in chunks] == steps
    assert [c.start_sample for c in chunks] == list(np.cumsum([0, *steps[:-1]]))
    # Joined, they are the segment's latents decoded at once.
    whole = talker_models.vae.decoder.decode_whole(torch.cat(runner.latents)).numpy()
    got = np.frombuffer(b"".join(c.pcm16 for c in chunks), "<i2").astype(np.int32)
    want = np.frombuffer(pcm16(whole), "<i2").astype(np.int32)
    assert got.shape == want.shape == (spoken.num_samples,)
    assert np.abs(want).mean() > 30  # audible: not two silences compared
    assert np.abs(got - want).max() <= 1  # float rounding of the streamed maths, at most one PCM step
