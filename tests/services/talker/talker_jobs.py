"""Jobs for the talker engine tests: a recorder of a job's events, a job from a preset voice, stepping an
engine by hand until jobs end."""

from __future__ import annotations

import numpy as np
import torch
from omnistage.services.talker.request_flow import JobAudio, JobDone, JobFailed, SegmentJob, TalkerEngine


class Recorder:
    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)

    @property
    def audio(self) -> np.ndarray:
        return np.concatenate([e.samples for e in self.events if isinstance(e, JobAudio)])

    @property
    def done(self) -> JobDone | None:
        return next((e for e in self.events if isinstance(e, JobDone)), None)


def job(models, voices, text="Hello there, my friend.", seed=1, max_steps=6, min_steps=100, voice="DB30"):
    v = voices.presets[voice]
    rec = Recorder()
    j = SegmentJob(
        models.prompt.build(text, v.prompt_text, v.patches),
        v,
        max_steps,
        torch.Generator().manual_seed(seed),
        rec,
        min_steps=min_steps,
    )
    return j, rec


def run(engine: TalkerEngine, *recs: Recorder, limit: int = 100) -> None:
    for _ in range(limit):
        if all(r.done or any(isinstance(e, JobFailed) for e in r.events) for r in recs):
            return
        engine.step()
    raise AssertionError("jobs did not finish")


def run_staggered(engine: TalkerEngine, models, voices, specs: list[dict]) -> list[Recorder]:
    """Submit `specs` with the first one step ahead (rows at different positions share the rest), run all."""
    recs = []
    for i, spec in enumerate(specs):
        j, rec = job(models, voices, **spec)
        engine.submit(j)
        recs.append(rec)
        if i == 0:
            engine.step()
    run(engine, *recs)
    return recs
