"""The `omnistage` command against a running synthetic stage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "runtime"))
from omnistage.common.cli import main  # noqa: E402
from omnistage.common.runtime.deadlines import wait_for  # noqa: E402
from omnistage.common.runtime.status_file import read_status, status_path  # noqa: E402
from synthetic_stage import SCRIPT, free_port, write_config  # noqa: E402


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """One synthetic stage, SERVING, shared by the tests of this module: (config path, address)."""
    tmp = tmp_path_factory.mktemp("cli")
    cfg = write_config(tmp / "deploy.yaml", {"alpha": {}})
    run = tmp / "run"
    proc = subprocess.Popen([sys.executable, SCRIPT, "--config", str(cfg), "--service", "alpha", "--run-dir", str(run)])
    try:
        path = status_path(run, "alpha", 0)
        rec = wait_for(lambda: (r := read_status(path)) is not None and r.phase == "serving" and r, 60, "alpha serving")
        yield cfg, rec.address
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("serve", "make-tiny-checkpoint", "generate", "status", "protos"):
        assert command in out


def test_module_entry_point_runs():
    result = subprocess.run([sys.executable, "-m", "omnistage.common.cli", "--help"], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and "usage: omnistage" in result.stdout


def test_status_of_a_running_stage(stage, capsys):
    _, address = stage
    assert main(["status", "--address", address]) == 0
    out = capsys.readouterr().out
    assert f"alpha (thinker) at {address}: SERVING, phase serving" in out
    assert "memory cpu: total 4.0 MiB" in out and "max_running 4" in out


def test_status_of_every_service_of_a_deploy_file(stage, capsys):
    cfg, address = stage
    assert main(["status", "--config", str(cfg)]) == 0
    assert f"alpha (thinker) at {address}: SERVING" in capsys.readouterr().out


def test_status_of_an_unreachable_service_exits_1(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert main(["status", "--address", address, "--timeout-s", "0.5"]) == 1
    assert f"{address}  unreachable: " in capsys.readouterr().out


def test_generate_streams_text_then_finish(stage, capsys):
    _, address = stage
    assert main(["generate", "--address", address, "--prompt", "n=3", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("w0 w1 w2 \n")
    assert "[finish: stop, prompt_tokens=1, completion_tokens=3" in out


def test_generate_error_exits_1_with_the_status(stage, capsys):
    _, address = stage
    assert main(["generate", "--address", address, "--prompt", "invalid"]) == 1
    assert "generate failed: INVALID_ARGUMENT: messages[0]: synthetic invalid request" in capsys.readouterr().err


def test_protos_check_is_clean_on_a_fresh_tree(capsys):
    assert main(["protos", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "omnistage"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=60,
                            env=dict(os.environ))
    assert result.returncode == 0 and "serve" in result.stdout
