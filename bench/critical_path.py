"""Which device ops a profiled stretch of decode steps waits on: each op's share of the device span.

With programmatic dependent launch a kernel starts (its programs are resident and read their
weights) while the kernel before it still runs, so the profiler's time by kernel counts the overlap
twice and says little about what a step waits for. Here the device ops are walked in start order
and each is charged only the time its end lies past every earlier op's end (what it added to the
span), and the idle time before it (no op running: the host, or a launch, was late). The charges sum
to the span from the first op's start to the last op's end.
"""

from __future__ import annotations

from collections import defaultdict


def device_intervals(prof) -> list[tuple[str, float, float]]:
    """(name, start µs, end µs) of every device op of a torch.profiler run, in start order."""
    from torch.autograd import DeviceType

    events = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    return sorted(((e.name, e.time_range.start, e.time_range.end) for e in events), key=lambda t: t[1])


def charges(intervals: list[tuple[str, float, float]]) -> tuple[dict[str, float], dict[str, float]]:
    """Per op name: the µs its ends added past the latest earlier end, and the idle µs before it."""
    added: dict[str, float] = defaultdict(float)
    idle: dict[str, float] = defaultdict(float)
    if not intervals:
        return added, idle
    latest = intervals[0][1]
    for name, start, end in intervals:
        if start > latest:
            idle[name] += start - latest
        if end > latest:
            added[name] += end - max(start, latest)
            latest = end
    return dict(added), dict(idle)


def summary(prof, steps: int, top: int = 14) -> dict:
    """The charges per step (ms), largest first: `added` by op, `idle` by the op that followed it,
    and their totals (their sum is the device span of the stretch, divided by `steps`)."""
    added, idle = charges(device_intervals(prof))

    def rows(d: dict[str, float]) -> list[dict]:
        ranked = sorted(d.items(), key=lambda kv: -kv[1])
        return [{"op": k[:90], "ms_per_step": round(v / steps / 1e3, 4)} for k, v in ranked[:top]]

    return {
        "added_ms": round(sum(added.values()) / steps / 1e3, 4),
        "idle_ms": round(sum(idle.values()) / steps / 1e3, 4),
        "added": rows(added),
        "idle": rows(idle),
    }


def print_summary(label: str, s: dict) -> None:
    print(
        f"[critical] {label}: {s['added_ms']:.3f} ms a step of device span from ops, {s['idle_ms']:.3f} ms idle",
        flush=True,
    )
    for r in s["added"]:
        print(f"  {r['ms_per_step']:8.4f} ms  {r['op']}", flush=True)
    for r in s["idle"][:5]:
        print(f"  {r['ms_per_step']:8.4f} ms idle before  {r['op']}", flush=True)
