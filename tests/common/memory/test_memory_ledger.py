"""The per-GPU ledger: budgets + reserve must fit each device, refused with a table before anything starts."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest
import yaml
from omnistage.common.config import config_from_dict
from omnistage.common.launcher import launch
from omnistage.common.memory.ledger import LedgerError, check_deploy_memory, check_ledger, placements

GiB = 1 << 30
MiB = 1 << 20


def _cfg(services: dict, **devices) -> object:
    svcs = {}
    for i, (name, extra) in enumerate(services.items()):
        svcs[name] = {"kind": "thinker", "port": 50200 + 10 * i, **extra}
        if svcs[name].get("tp_size", 1) > 1:
            svcs[name]["dist_port"] = 50500 + 10 * i
    return config_from_dict({"devices": devices, "services": svcs})


def test_tp_ranks_land_on_their_gpus_and_share_devices():
    cfg = _cfg(
        {
            "thinker": {"device": "cuda", "tp_size": 2, "gpus": [2, 3], "memory": {"budget_fraction": 0.5}},
            "talker": {"kind": "talker", "device": "cuda", "memory": {"budget_bytes": 10 * GiB}},
            "gateway": {"kind": "gateway"},
        }
    )
    place = {dev: [(s.name, r) for s, r in ranks] for dev, ranks in placements(cfg).items()}
    assert place == {"cuda:2": [("thinker", 0)], "cuda:3": [("thinker", 1)], "cuda:0": [("talker", 0)]}


def test_budgets_that_fit_pass_with_fractions_resolved_per_device():
    cfg = _cfg(
        {
            "thinker": {"device": "cuda", "tp_size": 2, "memory": {"budget_fraction": 0.5}},
            "talker": {"kind": "talker", "device": "cuda", "memory": {"budget_bytes": 30 * GiB}},
        },
        reserve_bytes=2 * GiB,
    )
    report = check_ledger(cfg, {"cuda:0": 80 * GiB, "cuda:1": 40 * GiB})
    by_dev = {d.device: d for d in report.devices}
    assert by_dev["cuda:0"].used == 40 * GiB + 30 * GiB + 2 * GiB
    assert by_dev["cuda:1"].used == 20 * GiB + 2 * GiB
    assert report.fits and "cuda:0: 72.00 GiB of 80.00 GiB budgeted" in report.summary()


def test_overshoot_raises_a_table_naming_device_services_reserve_total_and_overshoot():
    cfg = _cfg(
        {
            "thinker": {"device": "cuda", "tp_size": 2, "memory": {"budget_fraction": 0.75}},
            "talker": {"kind": "talker", "device": "cuda", "gpus": [1], "memory": {"budget_bytes": 20 * GiB}},
        },
        reserve_bytes=4 * GiB,
    )
    with pytest.raises(LedgerError) as exc:
        check_ledger(cfg, {"cuda:0": 80 * GiB, "cuda:1": 80 * GiB})
    msg = str(exc.value)
    assert "budgets exceed device memory on cuda:1" in msg
    lines = msg.splitlines()[1:]
    assert all(line.split()[0] in ("device", "cuda:1") for line in lines)  # only the refused device
    assert any("thinker (rank 1)" in line and "60.00 GiB (0.75 x 80.00 GiB)" in line for line in lines)
    assert any("talker (rank 0)" in line and "20.00 GiB" in line for line in lines)
    assert any("reserve" in line and "4.00 GiB" in line for line in lines)
    assert any("total" in line and "80.00 GiB" in line for line in lines)
    assert any("overshoot" in line and "4.00 GiB" in line for line in lines)  # 60 + 20 + 4 - 80
    assert not exc.value.report.fits


def test_unbudgeted_services_are_listed_but_not_summed_and_unknown_totals_refuse():
    cfg = _cfg({"a": {"device": "cuda", "memory": {"budget_bytes": 10 * GiB}}, "b": {"device": "cuda"}})
    (dev,) = check_ledger(cfg, {"cuda:0": 16 * GiB}).devices
    assert dev.used == 10 * GiB and [e.budget for e in dev.entries] == [10 * GiB, 0]
    with pytest.raises(LedgerError, match="no total size known for device cuda:0"):
        check_ledger(cfg, {})
    assert (
        check_deploy_memory(_cfg({"b": {"device": "cuda"}})).devices == ()
    )  # nothing budgeted: no CUDA query


def test_simulated_gpus_are_shared_by_index_and_must_agree_on_capacity():
    sim = {"simulated_capacity_bytes": 512 * MiB}
    cfg = _cfg(
        {
            "thinker": {"memory": {**sim, "budget_bytes": 300 * MiB}},
            "talker": {"kind": "talker", "memory": {**sim, "budget_fraction": 0.25}},
        }
    )
    (dev,) = check_deploy_memory(cfg).devices
    assert (dev.device, dev.total, dev.used) == ("sim:0", 512 * MiB, 300 * MiB + 128 * MiB)
    over = _cfg(
        {
            "thinker": {"memory": {**sim, "budget_bytes": 400 * MiB}},
            "talker": {"kind": "talker", "memory": {**sim, "budget_fraction": 0.25}},
        }
    )
    with pytest.raises(LedgerError, match="overshoot"):
        check_deploy_memory(over)
    apart = _cfg(
        {
            "thinker": {"memory": {**sim, "budget_bytes": 400 * MiB}},
            "talker": {"kind": "talker", "gpus": [1], "memory": {**sim, "budget_fraction": 0.25}},
        }
    )
    assert [d.device for d in check_deploy_memory(apart).devices] == ["sim:0", "sim:1"]
    clash = _cfg(
        {
            "thinker": {"memory": sim},
            "talker": {
                "kind": "talker",
                "memory": {"simulated_capacity_bytes": 256 * MiB, "budget_bytes": MiB},
            },
        }
    )
    with pytest.raises(LedgerError, match="simulated GPU sim:0 has capacity"):
        check_deploy_memory(clash)


def test_total_bytes_override_replaces_the_driver_number():
    cfg = _cfg(
        {"thinker": {"device": "cuda", "tp_size": 2, "memory": {"budget_fraction": 0.9}}},
        total_bytes_override=24 * GiB,
        reserve_bytes=3 * GiB,
    )
    with pytest.raises(LedgerError, match="cuda:0, cuda:1"):
        check_deploy_memory(cfg)  # 21.6 + 3 > 24 on both, without touching CUDA


def test_launch_refuses_a_ledger_that_does_not_fit_and_starts_nothing(tmp_path: Path):
    marker = tmp_path / "started"
    stage = tmp_path / "stage.py"
    stage.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('x')\n")
    sim = {"simulated_capacity_bytes": 1 * GiB}
    data = {
        "version": 1,
        "devices": {"reserve_bytes": 256 * MiB},
        "services": {
            "thinker": {"kind": "thinker", "port": 50301, "memory": {**sim, "budget_fraction": 0.6}},
            "talker": {"kind": "talker", "port": 50302, "memory": {**sim, "budget_bytes": 256 * MiB}},
        },
    }
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(yaml.safe_dump(data))
    out, err = io.StringIO(), io.StringIO()
    code = launch(
        cfg,
        [],
        modules={"thinker": str(stage), "talker": str(stage)},
        out=out,
        err=err,
        run_dir=tmp_path / "run",
        exit_after_ready=True,
    )
    assert code == 2
    assert "budgets exceed device memory on sim:0" in err.getvalue()
    assert "overshoot" in err.getvalue() and "thinker (rank 0)" in err.getvalue()
    assert "started" not in out.getvalue()
    assert not marker.exists()


@pytest.mark.skipif(sys.platform != "linux", reason="pidfd launcher")
def test_launch_with_a_fitting_ledger_prints_it_and_starts(tmp_path: Path):
    from tests.common.runtime.synthetic_stage import SCRIPT, write_config

    cfg = write_config(
        tmp_path / "deploy.yaml",
        {"alpha": {"memory": {"simulated_capacity_bytes": GiB, "budget_fraction": 0.5}}},
    )
    out, err = io.StringIO(), io.StringIO()
    code = launch(
        cfg,
        [],
        modules={"thinker": SCRIPT},
        out=out,
        err=err,
        exit_after_ready=True,
        ready_file=tmp_path / "ready",
    )
    assert code == 0, err.getvalue()
    assert "memory ledger: sim:0: 512.00 MiB of 1.00 GiB budgeted" in out.getvalue()
    assert "ready in" in out.getvalue()
