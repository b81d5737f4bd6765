"""Statistics of a load run: per-request records in, one summary (latency percentiles, throughput,
goodput, errors by status) out. No gRPC here, so the arithmetic has unit tests of its own. Shared by
`omnistage bench` and load_tests/pipeline_load.py (load_driver.py makes the records).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field


@dataclass
class Record:
    """One request as the client saw it (seconds, from the client's monotonic clock)."""

    kind: str  # text | speech | image
    start: float
    end: float
    # The request's goodput deadline: OK and end - start within it counts towards goodput.
    deadline_s: float
    # "OK", a gRPC status name (UNAVAILABLE, DEADLINE_EXCEEDED, ...), FINISH_ERROR / FINISH_ABORT, or
    # AUDIO_<code> for speech that did not come out complete.
    code: str = "OK"
    completion_tokens: int = 0
    # Why it failed, in the server's words (the RPC's details, or the finish's audio message).
    detail: str = ""
    # Offsets from `start` of the first text delta / first audio chunk; None when there was none.
    first_text_s: float | None = None
    first_audio_s: float | None = None
    # Offset of the last text delta (speech goes on after it: TPOT is timed on the text alone).
    last_text_s: float | None = None
    audio_seconds: float = 0.0

    @property
    def e2e_s(self) -> float:
        return self.end - self.start

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def good(self) -> bool:
        return self.ok and self.e2e_s <= self.deadline_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (last text - first text) / (tokens - 1); without the
        last delta's time, (E2E - TTFT) / (tokens - 1)."""
        if self.first_text_s is None or self.completion_tokens < 2:
            return None
        last = self.e2e_s if self.last_text_s is None else self.last_text_s
        return (last - self.first_text_s) / (self.completion_tokens - 1)

    @property
    def rtf(self) -> float | None:
        """Real-time factor of speech: E2E / seconds of audio (< 1: faster than it plays)."""
        return self.e2e_s / self.audio_seconds if self.audio_seconds > 0 else None


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between the closest ranks (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class Summary:
    """One run (one mode, one load level, one request kind)."""

    mode: str
    kind: str
    load: str  # the concurrency, "all" (offline) or the Poisson rate ("2.0/s")
    requests: int
    wall_s: float
    ok: int
    good: int
    req_per_s: float
    tok_per_s: float
    goodput_per_s: float
    e2e_ms: dict[str, float | None] = field(default_factory=dict)
    ttft_ms: dict[str, float | None] = field(default_factory=dict)
    tpot_ms: dict[str, float | None] = field(default_factory=dict)
    ttfa_ms: dict[str, float | None] = field(default_factory=dict)
    rtf: dict[str, float | None] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    # The first failed request's detail for each code in `errors` (what a person reads first).
    error_details: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


def _pcts(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    out = {}
    for q in (50, 95, 99):
        v = percentile(values, q)
        out[f"p{q}"] = None if v is None else round(v * scale, 3)
    return out


def _first_details(records: list[Record]) -> dict[str, str]:
    details: dict[str, str] = {}
    for r in records:
        if not r.ok and r.code not in details:
            details[r.code] = r.detail[:500]
    return details


def summarize(mode: str, kind: str, load: str, records: list[Record], wall_s: float) -> Summary:
    """Rates over the run's wall time; latencies over the requests that finished OK."""
    ok = [r for r in records if r.ok]
    wall = max(wall_s, 1e-9)
    return Summary(
        mode=mode,
        kind=kind,
        load=load,
        requests=len(records),
        wall_s=round(wall_s, 3),
        ok=len(ok),
        good=sum(r.good for r in records),
        req_per_s=round(len(ok) / wall, 3),
        tok_per_s=round(sum(r.completion_tokens for r in ok) / wall, 3),
        goodput_per_s=round(sum(r.good for r in records) / wall, 3),
        e2e_ms=_pcts([r.e2e_s for r in ok]),
        ttft_ms=_pcts([r.first_text_s for r in ok if r.first_text_s is not None]),
        tpot_ms=_pcts([t for r in ok if (t := r.tpot_s) is not None]),
        ttfa_ms=_pcts([r.first_audio_s for r in ok if r.first_audio_s is not None]),
        rtf=_pcts([x for r in ok if (x := r.rtf) is not None], scale=1.0),
        errors=dict(Counter(r.code for r in records if not r.ok)),
        error_details=_first_details(records),
    )


def failures(summaries: list[Summary]) -> list[str]:
    """One line per run with requests that did not finish as asked: what `omnistage bench` says on
    stderr when it exits 1 (`speech closed c=4: 14 of 16 not done: AUDIO_RESOURCE_EXHAUSTED 14`)."""
    lines = []
    for s in summaries:
        if s.errors:
            codes = ", ".join(
                f"{code} {n}" for code, n in sorted(s.errors.items(), key=lambda kv: (-kv[1], kv[0]))
            )
            lines.append(
                f"{s.kind} {s.mode} c={s.load}: {sum(s.errors.values())} of {s.requests} not done: {codes}"
            )
    return lines


def _ms(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f} ms" if v >= 10 else f"{v:.1f} ms"


def markdown_table(summaries: list[Summary]) -> str:
    """| Mode | Concurrency | Reqs | Wall | E2E p50 | E2E p95 | req/s | tok/s | goodput |"""
    lines = [
        "| Mode | Concurrency | Reqs | Wall | E2E p50 | E2E p95 | req/s | tok/s | goodput |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        errs = f" ({sum(s.errors.values())} errors)" if s.errors else ""
        lines.append(
            f"| {s.mode} {s.kind} | {s.load} | {s.requests}{errs} | {s.wall_s:.1f} s | "
            f"{_ms(s.e2e_ms.get('p50'))} | {_ms(s.e2e_ms.get('p95'))} | {s.req_per_s:.2f} | "
            f"{s.tok_per_s:.1f} | {s.goodput_per_s:.2f}/s |"
        )
    return "\n".join(lines)


def details_table(summaries: list[Summary]) -> str:
    """The latencies the main table leaves out: TTFT, TPOT, TTFA, RTF, p99, errors by status."""
    lines = [
        "| Mode | Concurrency | E2E p99 | TTFT p50 / p95 | TPOT p50 | TTFA p50 / p95 | RTF p50 | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        rtf = s.rtf.get("p50")
        errs = ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items())) or "—"
        lines.append(
            f"| {s.mode} {s.kind} | {s.load} | {_ms(s.e2e_ms.get('p99'))} | "
            f"{_ms(s.ttft_ms.get('p50'))} / {_ms(s.ttft_ms.get('p95'))} | {_ms(s.tpot_ms.get('p50'))} | "
            f"{_ms(s.ttfa_ms.get('p50'))} / {_ms(s.ttfa_ms.get('p95'))} | "
            f"{'—' if rtf is None else f'{rtf:.2f}'} | {errs} |"
        )
    return "\n".join(lines)
