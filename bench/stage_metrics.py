"""Where a request's time went, from every service's own /metrics: the mean of each latency histogram
over a benchmark level (the difference of two snapshots), so a client-side figure can be split into
the stages' parts (encoder call and its queue, preparation and forward, items per forward; thinker
queue and first token, talker queue, first audio and step; a Converse turn's media and first text; each
service's tensor hand-overs), and what some counters counted meanwhile (the gateway's encode cache, the
encoder's forwards)."""

from __future__ import annotations

import urllib.request

from omnistage.common.config import DeployConfig

# Histograms that split a spoken turn: (metric name, label that tells series apart, or "", or labels
# joined by commas: a series per combination, "[media,first]"; a line without one of them is skipped).
SPLIT = (
    ("gateway_ttft_seconds", "modality"),
    ("gateway_ttfa_seconds", ""),
    ("gateway_turn_seconds", "phase"),
    ("gateway_turn_seconds", "phase,turn"),  # a Converse call's first turn apart from its later ones
    ("rpc_latency_seconds", "method"),
    ("encoder_queue_time_seconds", ""),
    ("encoder_prepare_seconds", "kind"),
    ("encoder_forward_seconds", "modality"),
    ("encoder_batch_items", "modality"),
    ("transport_transfer_seconds", "direction"),
    ("thinker_queue_time_seconds", ""),
    ("thinker_ttft_seconds", ""),
    ("talker_queue_time_seconds", ""),
    ("talker_ttfa_seconds", ""),
    ("talker_step_seconds", ""),
    ("talker_step_batch", ""),
)

# Counters counted over a level: (metric name, label that tells series apart).
COUNTS = (
    ("gateway_encode_cache_lookups_total", "result"),
    ("gateway_encode_cache_ahead_total", "outcome"),
    ("encoder_batches_total", "modality"),
)

Snapshot = dict[str, tuple[float, float]]  # "service/metric[label]" → (sum, count); a counter: (value, -1)


def metric_urls(cfg: DeployConfig) -> dict[str, str]:
    return {
        name: f"http://{cfg.host}:{svc.metrics_port}/metrics"
        for name, svc in cfg.services.items()
        if svc.metrics_port
    }


def _label(line: str, key: str) -> str:
    """The value of label `key` in a metric line ("" without it); of labels "a,b": their values joined
    by a comma ("" unless the line has them all)."""
    values = []
    for k in key.split(",") if key else ():
        if f'{k}="' not in line:
            return ""
        values.append(line.split(f'{k}="', 1)[1].split('"', 1)[0])
    return ",".join(values)


def snapshot(urls: dict[str, str]) -> Snapshot:
    out: Snapshot = {}
    for service, url in urls.items():
        try:
            text = urllib.request.urlopen(url, timeout=10).read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            for metric, key in COUNTS:
                if line.startswith(f"omnistage_{metric}{{"):
                    label = _label(line, key)
                    name = f"{service}/{metric}" + (f"[{label}]" if label else "")
                    value = out.get(name, (0.0, -1.0))[0] + float(line.rsplit(" ", 1)[1])
                    out[name] = (value, -1.0)
            for metric, key in SPLIT:
                for suffix, i in (("_sum", 0), ("_count", 1)):
                    if not line.startswith(f"omnistage_{metric}{suffix}"):
                        continue
                    label = _label(line, key)
                    if "," in key and not label:
                        continue
                    name = f"{service}/{metric}" + (f"[{label}]" if label else "")
                    pair = list(out.get(name, (0.0, 0.0)))
                    pair[i] += float(line.rsplit(" ", 1)[1])
                    out[name] = (pair[0], pair[1])
    return out


def means(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """Each series' mean over what was observed between the snapshots (ms for seconds, else as is)."""
    out = {}
    for name, (s, c) in sorted(after.items()):
        s0, c0 = before.get(name, (0.0, 0.0))
        if c >= 0 and c - c0 > 0:
            mean = (s - s0) / (c - c0)
            out[name] = round(mean * 1000.0, 1) if "seconds" in name else round(mean, 2)
    return out


def counted(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """What each counter of `COUNTS` counted between the snapshots."""
    return {
        name: value - before.get(name, (0.0, -1.0))[0]
        for name, (value, c) in sorted(after.items())
        if c < 0 and value - before.get(name, (0.0, -1.0))[0]
    }
