"""The deploy file loader: strict types, key paths in every error, overrides, port clashes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omnistage.common.config import (
    ConfigError,
    DeployConfig,
    FaultConfig,
    apply_overrides,
    config_from_dict,
    config_hash,
    load_config,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[2]


def base() -> dict:
    return {
        "services": {
            "thinker": {
                "kind": "thinker",
                "port": 7161,
                "admin_port": 7162,
                "metrics_port": 9461,
                "tp_size": 2,
                "dist_port": 29561,
            },
            "gateway": {"kind": "gateway", "port": 7151},
        }
    }


def error_of(data: dict) -> str:
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    return str(err.value)


def test_shipped_deploy_file_loads():
    cfg = load_config(ROOT / "deploy" / "local-tiny.yaml")
    assert isinstance(cfg, DeployConfig)
    assert cfg.service("thinker").kind == "thinker" and cfg.services_of("gateway")[0].name == "gateway"
    assert cfg.address("gateway") == f"{cfg.host}:{cfg.service('gateway').port}"
    for svc in cfg.services.values():
        assert svc.admin_port, f"services.{svc.name}: every shipped service has an admin port"
        for key in ("port", "admin_port", "metrics_port"):  # clear of Linux's ephemeral range (32768-60999)
            assert not 32768 <= getattr(svc, key) <= 60999, f"services.{svc.name}.{key}"

    enc = load_config(ROOT / "deploy" / "local-tiny-encoder.yaml").service("encoder")
    assert enc.kind == "encoder" and enc.encoder.stress_batch_sizes == (4, 2, 1)
    img = load_config(ROOT / "deploy" / "local-tiny-imagegen.yaml").service("imagegen")
    assert img.kind == "imagegen" and img.admin_port and img.imagegen.highres == 512
    for key in ("port", "admin_port", "metrics_port"):
        assert not 32768 <= getattr(img, key) <= 60999, f"services.imagegen.{key}"

    talker = load_config(ROOT / "deploy" / "local-tiny-talker.yaml").service("talker")
    assert talker.kind == "talker" and talker.admin_port and talker.talker.stress_batch_sizes == (4, 2, 1)
    assert talker.talker.default_voice == "DB30" and not 32768 <= talker.port <= 60999


@pytest.mark.parametrize(
    ("talker", "needle"),
    [
        ({"max_text_chars": 0}, "services.thinker.talker.max_text_chars: expected > 0, got 0"),
        ({"temperature": -1.0}, "services.thinker.talker.temperature: expected >= 0"),
        (
            {"stress_batch_sizes": [4, 0]},
            "services.thinker.talker.stress_batch_sizes: expected batch sizes >= 1",
        ),
        ({"default_voice": " "}, "services.thinker.talker.default_voice: expected a preset voice name"),
        ({"voices": 2}, "services.thinker.talker.voices"),
    ],
)
def test_talker_knobs_are_checked(talker, needle):
    data = base()
    data["services"]["thinker"]["talker"] = talker
    with pytest.raises(ConfigError) as err:
        config_from_dict(data)
    assert needle in str(err.value)


def test_access_keys_and_dial_addresses():
    data = base()
    data["services"]["gateway"].update(
        {
            "bind_host": "0.0.0.0",
            "admin_port": 7152,
            "admin_api_key_env": "GW_ADMIN_KEY",
            "tls": {"cert_file": "c.pem", "key_file": "k.pem"},
            "api_keys_env": "GW_KEYS",
            "api_keys_file": "keys.txt",
            "gateway": {"media_dir": "/srv/media"},
        }
    )
    cfg = config_from_dict(data)
    gw, th = cfg.service("gateway"), cfg.service("thinker")
    assert (gw.tls.cert_file, gw.tls.client_ca_file, gw.gateway.media_dir) == ("c.pem", "", "/srv/media")
    assert cfg.address("gateway") == "127.0.0.1:7151"  # a wildcard bind is dialed at `host`
    assert (
        cfg.admin_address("gateway") == "127.0.0.1:7152" and cfg.admin_address("thinker") == "127.0.0.1:7162"
    )
    assert (th.bind_host, th.admin_host, th.tls, th.api_keys_env) == ("127.0.0.1", "127.0.0.1", None, "")
    data["services"]["thinker"]["bind_host"] = "::1"
    assert config_from_dict(data).address("thinker") == "[::1]:7161"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"services": {"gateway": {"admin_api_key_env": "K"}}},
            "services.gateway.admin_api_key_env: set admin_port too",
        ),
        (
            {"services": {"thinker": {"tls": {"cert_file": "c", "key_file": "k"}}}},
            "services.thinker.tls: only the gateway serves clients from outside (kind is thinker)",
        ),
        ({"services": {"thinker": {"api_keys_env": "K"}}}, "services.thinker.api_keys_env: only the gateway"),
        (
            {"services": {"thinker": {"api_keys_file": "k.txt"}}},
            "services.thinker.api_keys_file: only the gateway",
        ),
        (
            {"services": {"thinker": {"gateway": {"media_dir": "/m"}}}},
            "services.thinker.gateway.media_dir: only the",
        ),
        (
            {"services": {"gateway": {"admin_port": 7152, "tls": {"cert_file": "c"}}}},
            "services.gateway.tls.key_file: required when tls is set",
        ),
        (
            {"services": {"gateway": {"tls": {"cert_file": "c", "key_file": "k"}}}},
            "services.gateway.admin_port: required when tls is set",
        ),
        (
            {"services": {"gateway": {"admin_port": 7162}}},
            "services.gateway.admin_port: port 7162 is also used by services.thinker.admin_port",
        ),
        ({"services": {"gateway": {"bind_host": ""}}}, "services.gateway.bind_host: expected an address"),
        ({"services": {"gateway": {"tls": {"certfile": "c"}}}}, "services.gateway.tls.certfile: unknown key"),
    ],
)
def test_access_keys_are_checked(patch, message):
    assert message in error_of(_merge(base(), patch))


@pytest.mark.parametrize(
    "key",
    [
        "talker_start_wait_s",
        "talker_stream_wait_s",
        "talker_idle_timeout_s",
        "speech_buffer_events",
        "converse_max_turns",
        "converse_max_turn_chars",
        "converse_max_turn_audio_bytes",
    ],
)
def test_the_gateways_speech_keys_are_positive(key):
    assert f"services.gateway.gateway.{key}: expected > 0" in error_of(
        _merge(base(), {"services": {"gateway": {"gateway": {key: 0}}}})
    )
    cfg = config_from_dict(_merge(base(), {"services": {"gateway": {"gateway": {key: 3}}}}))
    assert getattr(cfg.service("gateway").gateway, key) == 3


def test_nested_values_and_names_are_filled_in():
    data = base()
    data["services"]["thinker"]["engine"] = {"block_size": 32}
    data["services"]["thinker"]["fault"] = {"phase": "warming_up", "action": "crash", "rank": 1}
    cfg = config_from_dict(data)
    t = cfg.service("thinker")
    assert t.name == "thinker" and t.engine.block_size == 32 and t.engine.max_num_seqs == 32
    assert t.fault == FaultConfig(phase="warming_up", action="crash", rank=1)
    assert cfg.service("gateway").fault is None


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"services": {"thinker": {"engine": {"blok_size": 8}}}},
            "services.thinker.engine.blok_size: unknown key",
        ),
        ({"startup": {"deadline": 1}}, "startup.deadline: unknown key"),
        ({"colour": "red"}, "colour: unknown key"),
        (
            {"services": {"thinker": {"engine": {"block_size": "x"}}}},
            "services.thinker.engine.block_size: expected an integer, got 'x'",
        ),
        (
            {"services": {"thinker": {"engine": {"block_size": 0}}}},
            "services.thinker.engine.block_size: expected > 0",
        ),
        (
            {"services": {"thinker": {"device": "tpu"}}},
            "services.thinker.device: expected one of 'cpu', 'cuda'",
        ),
        (
            {"services": {"thinker": {"engine": {"chunked_prefill": "yes"}}}},
            "services.thinker.engine.chunked_prefill: expected true/false",
        ),
        ({"services": {"thinker": {"gpus": 3}}}, "services.thinker.gpus: expected a list"),
        (
            {"services": {"thinker": {"fault": {"action": "explode"}}}},
            "services.thinker.fault.action: expected one of",
        ),
        (
            {"startup": {"phase_deadlines_s": {"loading": 5}}},
            "startup.phase_deadlines_s.loading: unknown phase",
        ),
        (
            {"startup": {"phase_deadlines_s": {"warming_up": -1}}},
            "startup.phase_deadlines_s.warming_up: expected > 0",
        ),
        ({"startup": {"cpu_warmup": "some"}}, "startup.cpu_warmup: expected one of 'minimal', 'full'"),
        (
            {"services": {"thinker": {"engine": {"grammar_server": "never"}}}},
            "services.thinker.engine.grammar_server: expected one of 'auto', 'startup', 'first_use'",
        ),
        ({"services": {"thinker": {"name": "other"}}}, "services.thinker.name: must equal the key 'thinker'"),
        (
            {"services": {"thinker": {"port": 70000}}},
            "services.thinker.port: expected a port number, got 70000",
        ),
        ({"services": {"thinker": {"tp_size": 0}}}, "services.thinker.tp_size: expected > 0"),
        (
            {"services": {"thinker": {"dist_port": 0}}},
            "services.thinker.dist_port: required when tp_size > 1",
        ),
        (
            {"services": {"thinker": {"device": "cuda", "gpus": [0]}}},
            "services.thinker.gpus: expected 2 GPU indices",
        ),
        (
            {"services": {"thinker": {"engine": {"chunked_prefill": False}}}},
            "services.thinker.engine.max_num_batched_tokens: must be >= max_model_len",
        ),
        ({"services": {"gw2": {"kind": "gateway", "port": 7153}}}, "services: at most one gateway"),
        ({"services": {"thinker": {"port": None}}}, "services.thinker.port: expected an integer, got None"),
        ({"services": {"thinker": 5}}, "services.thinker: expected a mapping"),
    ],
)
def test_bad_values_name_the_key_path(patch, message):
    assert message in error_of(_merge(base(), patch))


def test_missing_port_is_required():
    data = base()
    del data["services"]["gateway"]["port"]
    assert "services.gateway.port: required" in error_of(data)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"services": {"gateway": {"port": 7161}}},
            "services.gateway.port: port 7161 is also used by services.thinker.port",
        ),
        (
            {"services": {"gateway": {"metrics_port": 9461}}},
            "port 9461 is also used by services.thinker.metrics_port",
        ),
        # dist_port reserves one port per TP rank: 29561 and 29562.
        (
            {"services": {"gateway": {"port": 29562}}},
            "services.gateway.port: port 29562 is also used by services.thinker.dist_port",
        ),
        (
            {"services": {"thinker": {"metrics_port": 7161}}},
            "services.thinker.metrics_port: port 7161 is also used",
        ),
    ],
)
def test_port_clashes_name_both_keys(patch, message):
    assert message in error_of(_merge(base(), patch))


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"version": 2}, "version: expected 1"),
        ({"startup": {"heartbeat_timeout_s": 0}}, "startup.heartbeat_timeout_s: expected > 0"),
        ({"startup": {"poll_interval_s": -0.1}}, "startup.poll_interval_s: expected > 0"),
        ({"startup": {"rpc_timeout_s": 0}}, "startup.rpc_timeout_s: expected > 0"),
        ({"startup": {"stop_grace_s": -1}}, "startup.stop_grace_s: expected >= 0"),
        ({"services": {"thinker": {"drain_grace_s": -1}}}, "services.thinker.drain_grace_s: expected >= 0"),
        ({"services": {"thinker": {"fault": {"rank": 2}}}}, "services.thinker.fault.rank: expected -1"),
        (
            {"services": {"thinker": {"fault": {"delay_s": -1}}}},
            "services.thinker.fault.delay_s: expected >= 0",
        ),
        (
            {"services": {"thinker": {"engine": {"max_queued_requests": -1}}}},
            "services.thinker.engine.max_queued_requests: expected >= 0",
        ),
        (
            {"services": {"gateway": {"gateway": {"max_concurrent_requests": 0}}}},
            "services.gateway.gateway.max_concurrent_requests: expected > 0",
        ),
        (
            {"services": {"gateway": {"gateway": {"stage_wait_s": 0}}}},
            "services.gateway.gateway.stage_wait_s: expected > 0",
        ),
        (
            {"services": {"thinker": {"tp": {"serving_collective_timeout_s": 0}}}},
            "services.thinker.tp.serving_collective_timeout_s: expected > 0",
        ),
        (
            {"services": {"thinker": {"tp": {"peer_timeout_s": 0.5, "peer_watch_interval_s": 0.5}}}},
            "services.thinker.tp.peer_timeout_s: must be at least twice peer_watch_interval_s",
        ),
        (
            {"services": {"thinker": {"tp": {"failure_exit_s": 10}}}},
            "services.thinker.tp.failure_exit_s: must leave time after a silent peer is detected",
        ),
        ({"services": {"thinker": {"tp": {"deadline": 1}}}}, "services.thinker.tp.deadline: unknown key"),
        ({"model": {"load_format": "pt"}}, "model.load_format: expected one of 'safetensors', 'dummy'"),
        (
            {
                "services": {
                    "thinker": {"fault": {"at": "kv_rebuild", "action": "oom", "phase": "warming_up"}}
                }
            },
            "services.thinker.fault.at: kv_rebuild happens in phase profiling_memory, not warming_up",
        ),
        (
            {
                "services": {
                    "thinker": {"fault": {"at": "warmup_forward", "action": "hang", "phase": "warming_up"}}
                }
            },
            "services.thinker.fault.at: only for action oom of a thinker",
        ),
    ],
)
def test_timing_and_limit_values_are_checked(patch, message):
    assert message in error_of(_merge(base(), patch))


def test_overrides_apply_yaml_values_at_key_paths(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(base()))
    cfg = load_config(
        path,
        [
            "services.thinker.engine.block_size=8",
            "services.thinker.gpus=[4, 5]",
            "services.thinker.device=cuda",
            "startup.stop_grace_s=2.5",
            "log_format=json",
        ],
    )
    t = cfg.service("thinker")
    assert (t.engine.block_size, t.gpus, t.device) == (8, (4, 5), "cuda")
    assert cfg.startup.stop_grace_s == 2.5 and cfg.log_format == "json"


def test_override_errors_name_the_override_or_key(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(base()))
    with pytest.raises(ConfigError, match="--set 'services.thinker.tp_size': expected KEY.PATH=VALUE"):
        load_config(path, ["services.thinker.tp_size"])
    with pytest.raises(ConfigError, match="services.thinker.port is not a mapping"):
        load_config(path, ["services.thinker.port.x=1"])
    with pytest.raises(
        ConfigError, match="services.thinker.engine.block_size: expected an integer, got 'big'"
    ):
        load_config(path, ["services.thinker.engine.block_size=big"])


def test_override_into_an_empty_yaml_section(tmp_path):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(base()) + "startup:\n")
    assert load_config(path, ["startup.stop_grace_s=1"]).startup.stop_grace_s == 1.0


def test_parse_override_values_are_yaml():
    assert parse_override("a.b=3") == (["a", "b"], 3)
    assert parse_override("a=x=y") == (["a"], "x=y")
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])


def test_apply_overrides_to_a_non_mapping_file_is_a_config_error():
    with pytest.raises(ConfigError, match="top level"):
        apply_overrides([1, 2], ["a=1"])


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such deploy file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("services: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level"):
        load_config(listy)


def test_config_hash_changes_with_any_value():
    a = config_from_dict(base()).service("thinker")
    data = base()
    data["services"]["thinker"]["engine"] = {"max_num_seqs": 31}
    b = config_from_dict(data).service("thinker")
    assert config_hash(a) == config_hash(config_from_dict(base()).service("thinker"))
    assert config_hash(a) != config_hash(b) and len(config_hash(a)) == 64


def test_unknown_service_lookup_names_the_known_ones():
    with pytest.raises(ConfigError, match=r"services.talker: no such service \(have: thinker, gateway\)"):
        config_from_dict(base()).service("talker")


def _merge(data: dict, patch: dict) -> dict:
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            _merge(data[key], value)
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"max_items_per_request": 0}, "services.enc.encoder.max_items_per_request: expected > 0"),
        ({"max_audio_seconds": -1}, "services.enc.encoder.max_audio_seconds: expected > 0"),
        (
            {"image_min_pixels": 5000, "image_max_pixels": 4096},
            "services.enc.encoder.image_min_pixels: 5000 exceeds",
        ),
        ({"max_video_frames": 7}, "services.enc.encoder.max_video_frames: expected an even number, got 7"),
        (
            {"stress_batch_sizes": [4, 0]},
            "services.enc.encoder.stress_batch_sizes: expected batch sizes >= 1",
        ),
        ({"stress_batch_sizes": []}, "services.enc.encoder.stress_batch_sizes: expected batch sizes >= 1"),
        ({"inline_max_bytes": -1}, "services.enc.encoder.inline_max_bytes: expected >= 0"),
        ({"audio_batch_frames": -1}, "services.enc.encoder.audio_batch_frames: expected >= 0"),
        ({"max_pixels": 5}, "services.enc.encoder.max_pixels: unknown key"),
    ],
)
def test_encoder_limits_are_checked(patch, message):
    data = {"services": {"enc": {"kind": "encoder", "port": 50171, "encoder": patch}}}
    assert message in error_of(data)


def test_encoder_defaults_are_the_models_preprocessing_numbers():
    e = config_from_dict({"services": {"enc": {"kind": "encoder", "port": 50171}}}).services["enc"].encoder
    assert (e.image_min_pixels, e.image_max_pixels) == (4 * 32 * 32, 16384 * 32 * 32)
    assert (e.video_min_pixels, e.video_total_pixels, e.max_video_frames) == (
        128 * 32 * 32,
        96 * 128 * 32 * 32,
        256,
    )
    assert e.stress_batch_sizes == (8, 4, 2, 1)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"highres": 800}, "services.img.imagegen.highres: expected 512, 672 or 1024"),
        ({"min_side_px": 100}, "services.img.imagegen.min_side_px: expected a multiple of 16, got 100"),
        ({"default_side_px": 4096}, "services.img.imagegen.default_side_px: 4096 is outside [min_side_px 64"),
        ({"max_steps": 0}, "services.img.imagegen.max_steps: expected > 0"),
        (
            {"default_steps": 40, "max_steps": 30},
            "services.img.imagegen.default_steps: 40 exceeds max_steps 30",
        ),
        (
            {"max_guidance_scale": float("nan")},
            "services.img.imagegen.max_guidance_scale: expected a finite number",
        ),
        (
            {"default_guidance_scale": 30.0},
            "services.img.imagegen.default_guidance_scale: expected 0..max_guidance",
        ),
        (
            {"stress_batch_sizes": [2, 0]},
            "services.img.imagegen.stress_batch_sizes: expected batch sizes >= 1",
        ),
        ({"max_queued_requests": -1}, "services.img.imagegen.max_queued_requests: expected >= 0"),
        ({"size": 5}, "services.img.imagegen.size: unknown key"),
    ],
)
def test_imagegen_limits_are_checked(patch, message):
    data = {"services": {"img": {"kind": "imagegen", "port": 50181, "imagegen": patch}}}
    assert message in error_of(data)


def test_imagegen_defaults_are_the_models():
    g = config_from_dict({"services": {"img": {"kind": "imagegen", "port": 50181}}}).services["img"].imagegen
    assert (g.highres, g.default_side_px, g.default_steps, g.default_guidance_scale) == (1024, 1024, 30, 2.0)


def test_mps_mode_reads_a_bare_yaml_on_off_and_refuses_the_rest(tmp_path):
    for text, mode in (("off", "off"), ("on", "on"), ("auto", "auto")):
        path = tmp_path / f"{text}.yaml"
        path.write_text(yaml.safe_dump(base()) + f"devices:\n  mps:\n    mode: {text}\n")
        assert load_config(path).devices.mps.mode == mode  # YAML reads a bare off as False
        assert load_config(tmp_path / "off.yaml", [f"devices.mps.mode={text}"]).devices.mps.mode == mode
    assert "devices.mps.mode: expected one of 'auto', 'on', 'off', got 'sometimes'" in error_of(
        base() | {"devices": {"mps": {"mode": "sometimes"}}}
    )
    assert "devices.mps.start_timeout_s: expected > 0" in error_of(
        base() | {"devices": {"mps": {"start_timeout_s": 0}}}
    )
    data = base()
    data["services"]["thinker"]["mps_active_thread_percentage"] = 101
    assert "services.thinker.mps_active_thread_percentage: expected 0 (no limit) to 100" in error_of(data)


def test_every_model_stage_but_the_thinker_has_its_own_checked_section():
    """A new stage's limits are its module in common/config/ and one field of ServiceConfig named
    after its kind (common/stages.py): found and checked without another line of code."""
    from omnistage.common.config import STAGE_SECTIONS
    from omnistage.common.stages import MODEL_KINDS

    assert STAGE_SECTIONS == tuple(k for k in MODEL_KINDS if k != "thinker")
    for kind in STAGE_SECTIONS:
        data = base()
        data["services"]["thinker"][kind] = {"stress_batch_sizes": [0]}
        assert error_of(data) == (
            f"services.thinker.{kind}.stress_batch_sizes: expected batch sizes >= 1, got [0]"
        )


def test_only_a_plain_cpu_warms_up_minimally_unless_the_deploy_file_asks_for_all():
    minimal = DeployConfig().startup
    assert minimal.cpu_warmup == "minimal"
    assert not minimal.full_warmup("cpu")
    assert minimal.full_warmup("cpu", simulated_capacity_bytes=1 << 30)  # a budget to prove
    assert minimal.full_warmup("cuda:0") and minimal.full_warmup("cuda")
    full = config_from_dict({"startup": {"cpu_warmup": "full"}}).startup
    assert full.full_warmup("cpu")
