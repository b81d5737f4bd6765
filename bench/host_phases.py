"""Where the engine's host time goes per decode step (`LLMEngine.step_times`), summed over a run.

With async scheduling the host plans and queues step N+1 while the device runs step N, then waits
for step N's ids (`wait`). A `wait` near zero per step means the host, not the device, sets the
pace: the device idles between steps for whatever the host's other phases take beyond its step.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager


@contextmanager
def host_phases(engine):
    """Within the block, every `engine.step()` adds its phases' host seconds to the yielded dict
    (and one to its "steps")."""
    totals: dict[str, float] = defaultdict(float)
    step = engine.step

    def counted():
        try:
            return step()
        finally:
            for phase, seconds in engine.step_times.seconds.items():
                totals[phase] += seconds
            totals["steps"] += 1

    engine.step = counted
    try:
        yield totals
    finally:
        del engine.step  # the class's method again


def per_step_ms(totals: dict[str, float]) -> dict[str, float]:
    """Each phase's host milliseconds per step."""
    steps = max(1.0, totals.get("steps", 0.0))
    return {k: round(1e3 * v / steps, 4) for k, v in totals.items() if k != "steps"}
