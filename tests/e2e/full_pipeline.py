"""The full tiny pipeline the e2e tests share: one `omnistage serve` of gateway (API keys, the OpenAI
HTTP front), encoder, thinker, talker and image stage on the session's tiny checkpoint.

test_openai_front drives it through its clients, test_image_pipeline_e2e and test_multimodal_e2e (at
TP=1) through gRPC; the bench dry runs (bench/prefill_ttft.py and bench/realtime_latency.py with
`--attach`) time it as it runs; test_prometheus_live's Prometheus scrapes it under its own load. Each
start of a full pipeline costs ~40 s of CPU (five processes import torch and warm up): one start serves
them all. Its users only send requests (none kills, stops or drains a stage) and read metrics as deltas
over their own traffic. `stop` ends it as every e2e pipeline must end: SIGTERM, exit 0, every process
stopped cleanly, nothing left behind.
The sizes fit every user: the encoder's 4 s clips (the bench's 3 s audio case, the Realtime turns),
a context of 1,024 (the bench's 600-token prompts) and 8 sequences (its burst of 8), images up to
1024 px and 50 denoising steps (the image tests' limits), embeddings over 1 KiB by shared memory (the
leases the image and media tests check), encoder batches of 2, a media directory, and MAX_IN_FLIGHT
requests through the gateway (above the bench's burst of 8; test_prometheus_live's burst goes past it
for the dashboard's refusals)."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.serve_pipeline import ServeProcess, free_ports

KEY = "sk-test-openai-front"
KEYS_ENV = "OPENAI_FRONT_KEYS"
START_DEADLINE_S = 300.0
SERVICES = ("gateway", "thinker", "encoder", "talker", "imagegen")
MAX_IN_FLIGHT = 12  # the gateway's max_concurrent_requests


# The thinker's and the encoder's sizes (test_multimodal_e2e's TP=2 pipeline takes them too: the same
# greedy tokens as this one's TP=1).
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 256, "max_model_len": 1024}
ENCODER = {
    "image_max_pixels": 128 * 128,
    "max_audio_seconds": 4.0,  # the tiny checkpoint's n_ctx (200) allows 4 s
    "stress_batch_sizes": [2, 1],  # a plain CPU's start-up runs batch 1 only: batches of 2 for free
    "video_total_pixels": 8 * 64 * 64,
    "video_min_pixels": 64 * 64,
    "max_video_frames": 8,
    "inline_max_bytes": 1024,  # tiny rows are 1 KiB: every item goes by shared memory
}


def config(ckpt: Path, media_dir: Path) -> tuple[dict, dict[str, dict[str, int]]]:
    """The deploy dict (the gateway reads `Media.path` under `media_dir`) and each service's ports
    (port, admin_port, metrics_port; the thinker's dist_port, the gateway's http_port)."""
    ports = iter(free_ports(3 * len(SERVICES) + 2))
    where = {name: {k: next(ports) for k in ("port", "admin_port", "metrics_port")} for name in SERVICES}
    where["thinker"]["dist_port"] = next(ports)
    where["gateway"]["http_port"] = next(ports)
    services = {
        name: {"kind": name, **{k: where[name][k] for k in ("port", "admin_port", "metrics_port")}}
        for name in SERVICES
    }
    services["thinker"].update(dist_port=where["thinker"]["dist_port"], drain_grace_s=2.0, engine=ENGINE)
    services["encoder"]["encoder"] = ENCODER
    services["talker"]["talker"] = {
        "stress_batch_sizes": [1],
        "max_segment_seconds": 20,
        "max_lm_tokens": 512,
    }
    services["imagegen"].update(
        imagegen={
            "highres": 512,
            "max_side_px": 1024,
            "default_side_px": 64,
            "default_steps": 2,
            "max_steps": 50,
            "stress_batch_sizes": [1],
        },
        memory={"budget_bytes": 1 << 30, "simulated_capacity_bytes": 2 << 30},
    )
    services["gateway"].update(
        api_keys_env=KEYS_ENV,
        drain_grace_s=2.0,
        gateway={
            "http_port": where["gateway"]["http_port"],
            "http_max_body_bytes": 4 << 20,
            "max_concurrent_requests": MAX_IN_FLIGHT,
            "media_dir": str(media_dir),
        },
    )
    cfg = {
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "stop_grace_s": 5.0,
            "phase_deadlines_s": {"loading_weights": 240, "profiling_memory": 240, "warming_up": 240},
        },
        "services": services,
    }
    return cfg, where


def start(root: Path, ckpt: Path) -> dict:
    """The pipeline started and ready: where its front, gRPC gateway, deploy file, every service's
    ports and /metrics are."""
    media_dir = root / "media"
    media_dir.mkdir(exist_ok=True)
    cfg, where = config(ckpt, media_dir)
    serve = ServeProcess(root, cfg, env={KEYS_ENV: KEY}).wait_ready(START_DEADLINE_S)
    return {
        "base": f"http://127.0.0.1:{where['gateway']['http_port']}",
        "config": str(serve.cfg_path),
        "grpc": f"127.0.0.1:{where['gateway']['port']}",
        "root": root,
        "media_dir": media_dir,
        "serve": serve,
        "ports": where,
        "metrics": {
            name: f"http://127.0.0.1:{where[name]['metrics_port']}/metrics"
            for name in ("gateway", "thinker", "talker")
        },
    }


def stop(front: dict) -> None:
    """SIGTERM: `serve` exits 0, every service it started stops without an error and leaves no process
    or shared-memory segment."""
    serve: ServeProcess = front["serve"]
    started = set(serve.children())
    serve.stop()
    left = serve.leftovers()
    assert not left, f"left behind: {left}"
    assert started == {(name, 0) for name in SERVICES}, started
    out = serve.out.read_text()
    assert "all services stopped" in out and "while stopping" not in out, serve.logs()
