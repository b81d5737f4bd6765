"""The memory keys of the deploy file: budgets, simulated devices, KV pins, with key-path errors."""

from __future__ import annotations

import pytest
from omnistage.common.config import ConfigError, config_from_dict


def _cfg(**svc):
    base = {"port": 50100, "kind": "thinker"}
    return config_from_dict({"services": {"thinker": {**base, **svc}}})


def test_defaults_mean_no_budget_and_auto_profile():
    svc = _cfg().services["thinker"]
    assert not svc.memory.has_budget
    assert svc.engine.kv_tokens == 0 and svc.engine.kv_safety_factor == 1.0


def test_budget_fraction_is_of_the_device_total():
    svc = _cfg(device="cuda", memory={"budget_fraction": 0.25}).services["thinker"]
    assert svc.memory.budget_of(80 << 30) == 20 << 30
    svc = _cfg(device="cuda", memory={"budget_bytes": 5 << 30}).services["thinker"]
    assert svc.memory.budget_of(80 << 30) == 5 << 30


@pytest.mark.parametrize(
    ("svc", "path"),
    [
        ({"device": "cuda", "memory": {"budget_bytes": 1, "budget_fraction": 0.5}}, "memory.budget_bytes"),
        ({"device": "cuda", "memory": {"budget_fraction": 1.5}}, "memory.budget_fraction"),
        ({"memory": {"budget_bytes": 1 << 20}}, "services.thinker.memory: a budget on device cpu"),
        ({"device": "cuda", "memory": {"simulated_capacity_bytes": 1 << 30}}, "simulated_capacity_bytes"),
        ({"memory": {"simulated_capacity_bytes": 1 << 20, "budget_bytes": 2 << 20}}, "memory.budget_bytes"),
        ({"memory": {"budget_bytes": -1}}, "memory.budget_bytes"),
        ({"memory": {"oops": 1}}, "memory.oops: unknown key"),
        ({"engine": {"kv_tokens": 64, "num_kv_blocks": 4}}, "engine.kv_tokens"),
        ({"engine": {"kv_safety_factor": 0}}, "engine.kv_safety_factor"),
        ({"engine": {"kv_canary_bytes": -5}}, "engine.kv_canary_bytes"),
        ({"memory": {"simulated_capacity_bytes": 1 << 20}, "gpus": [0, 1]}, "gpus: expected 1 simulated"),
    ],
)
def test_bad_memory_keys_name_their_path(svc, path):
    with pytest.raises(ConfigError, match=path):
        _cfg(**svc)


def test_devices_section():
    cfg = config_from_dict({"devices": {"reserve_bytes": 1 << 30}, "services": {}})
    assert cfg.devices.reserve_bytes == 1 << 30
    with pytest.raises(ConfigError, match="devices.total_bytes_override"):
        config_from_dict({"devices": {"total_bytes_override": -1}})
