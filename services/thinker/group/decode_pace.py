"""How the thinker's decode step grows with its sequences' context, from the warm-up's own steps: the
gateway's start-up stress runs short answers, and a first burst of long ones runs its steps at a longer
context (each step attends over every sequence's), so it prices them by this (Describe's
`Limits.decode_step_times`, issue 43 point 5). The warm-up runs the full batch's decode at
max_model_len (its stress shape) and at one KV block (`warmup.decode_short_shape`, also the kernels of
a burst's first steps), each timed on the device: one short warm-up step, no run of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.config import ResolvedEngineConfig
from omnistage.services.thinker.group.warmup import WarmupResult, decode_short_shape, decode_stress_shape
from omnistage.v1 import control_pb2

log = get_logger(__name__)


@dataclass(frozen=True)
class DecodeStepTime:
    """One timed decode step: `sequences` at `context_tokens` each took `seconds` on the device."""

    sequences: int
    context_tokens: int
    seconds: float

    def to_proto(self) -> control_pb2.DecodeStepTime:
        return control_pb2.DecodeStepTime(
            sequences=self.sequences, context_tokens=self.context_tokens, seconds=self.seconds
        )


def decode_step_times(cfg: ResolvedEngineConfig, warmed: WarmupResult) -> list[DecodeStepTime]:
    """The full batch's decode at one KV block and at max_model_len, as the warm-up timed them; [] when
    it skipped either (the gateway then prices a step flat in context)."""
    shapes = [decode_short_shape(cfg), decode_stress_shape(cfg)]
    if shapes[0].context_lens == shapes[1].context_lens or any(s.name not in warmed.shape_s for s in shapes):
        return []
    times = [DecodeStepTime(s.num_seqs, max(s.context_lens), warmed.shape_s[s.name]) for s in shapes]
    log.info(
        "decode step of %d sequences: %s",
        times[0].sequences,
        ", ".join(f"{1000 * t.seconds:.1f} ms at {t.context_tokens} tokens of context" for t in times),
    )
    return times
