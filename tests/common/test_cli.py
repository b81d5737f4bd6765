"""The `omnistage` command against a running synthetic stage."""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml
from omnistage.common.cli import main  # noqa: E402
from omnistage.common.runtime.status_file import read_status, status_path  # noqa: E402

from tests.common.runtime.synthetic_stage import SCRIPT, free_port, write_config
from tests.waits import wait_for  # noqa: E402

KEY_ENV = "OMNISTAGE_CLI_TEST_KEYS"


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """A synthetic stage as the gateway `front`, with an admin port and an API key, SERVING on a port that only
    `--set` tells (the file says another): (config path, --set override, main address, admin address)."""
    tmp = tmp_path_factory.mktemp("cli")
    cfg = write_config(
        tmp / "deploy.yaml",
        {"front": {"kind": "gateway", "admin_port": free_port(), "api_keys_env": KEY_ENV}},
    )
    override = f"services.front.port={free_port()}"
    run = tmp / "run"
    previous = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = "cli-key-1,cli-key-2"
    proc = subprocess.Popen(
        [
            sys.executable,
            SCRIPT,
            "--config",
            str(cfg),
            "--service",
            "front",
            "--run-dir",
            str(run),
            "--set",
            override,
        ]
    )
    try:
        path = status_path(run, "front", 0)
        rec = wait_for(
            lambda: (r := read_status(path)) is not None and r.phase == "serving" and r, 60, "front serving"
        )
        admin = f"127.0.0.1:{yaml.safe_load(cfg.read_text())['services']['front']['admin_port']}"
        yield cfg, override, rec.address, admin
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if previous is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = previous


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in (
        "serve",
        "make-tiny-checkpoint",
        "generate",
        "status",
        "health",
        "drain",
        "resume",
        "protos",
    ):
        assert command in out


def test_module_entry_point_runs():
    result = subprocess.run(
        [sys.executable, "-m", "omnistage.common.cli", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and "usage: omnistage" in result.stdout


def test_status_of_one_admin_address(stage, capsys):
    _, _, _, admin = stage
    assert main(["status", "--address", admin]) == 0
    out = capsys.readouterr().out
    assert f"front (gateway) admin {admin}: SERVING, phase serving" in out
    assert "memory cpu: total 4.0 MiB" in out and "max_running 4" in out


def test_status_of_every_service_of_a_deploy_file_with_overrides(stage, capsys):
    cfg, override, address, admin = stage
    assert main(["status", "--config", str(cfg), "--set", override]) == 0
    assert f"front (gateway) admin {admin}: SERVING, phase serving" in capsys.readouterr().out
    assert (
        main(["status", "--config", str(cfg), "--set", override, "--set", "services.front.admin_port=0"]) == 0
    )
    assert f"front (gateway) at {address}: SERVING (no admin port" in capsys.readouterr().out


def test_health_of_a_serving_service_exits_0(stage, capsys):
    _, _, address, admin = stage
    for target in (address, admin):
        assert main(["health", target]) == 0
        assert capsys.readouterr().out.strip() == f"{target}: SERVING"


def test_health_of_an_unreachable_service_exits_1(capsys):
    assert main(["health", f"127.0.0.1:{free_port()}", "--timeout-s", "0.5"]) == 1
    assert "unreachable: " in capsys.readouterr().out


def test_health_from_a_status_file(tmp_path, capsys):
    from omnistage.common.runtime.status_file import StatusRecord, write_status

    path = status_path(tmp_path, "thinker", 2)
    assert main(["health", "--status-file", str(path)]) == 1  # not written yet
    write_status(path, StatusRecord("thinker", 2, 4242, "warming_up"))
    assert main(["health", "--status-file", str(path)]) == 1
    write_status(path, StatusRecord("thinker", 2, 4242, "serving"))
    assert main(["health", "--status-file", str(path)]) == 0
    write_status(path, StatusRecord("thinker", 2, 4242, "failed", failure="rank 0 died", failed_in="serving"))
    assert main(["health", "--status-file", str(path)]) == 1
    out = capsys.readouterr().out
    assert "thinker r2 (pid 4242): failed in serving: rank 0 died" in out
    assert main(["health"]) == 2


def test_status_of_an_unreachable_service_exits_1(capsys):
    address = f"127.0.0.1:{free_port()}"
    assert main(["status", "--address", address, "--timeout-s", "0.5"]) == 1
    assert f"{address}  unreachable: " in capsys.readouterr().out


def test_generate_finds_the_gateway_and_its_key_in_the_config(stage, capsys):
    cfg, override, _, _ = stage
    assert main(["generate", "--config", str(cfg), "--set", override, "--prompt", "n=3", "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("w0 w1 w2 \n")
    assert "[finish: stop, prompt_tokens=1, completion_tokens=3" in out


def test_generate_without_the_override_does_not_find_the_moved_port(stage, capsys):
    cfg, _, _, _ = stage
    assert main(["generate", "--config", str(cfg), "--prompt", "n=1", "--timeout-s", "2"]) == 1
    assert "generate failed: " in capsys.readouterr().err


def test_generate_by_address_needs_the_key(stage, capsys, monkeypatch):
    _, _, address, _ = stage
    assert main(["generate", "--address", address, "--prompt", "n=1"]) == 1
    assert (
        "generate failed: UNAUTHENTICATED: omnistage.v1.Omni: missing credentials" in capsys.readouterr().err
    )
    monkeypatch.setenv("MY_KEY", "cli-key-2")
    assert main(["generate", "--address", address, "--api-key-env", "MY_KEY", "--prompt", "n=1"]) == 0


def test_generate_says_when_nothing_listens_or_the_port_is_not_the_gateway(
    stage, tmp_path, monkeypatch, capsys
):
    """Issue 43.11: `generate` at a stage's port said only UNIMPLEMENTED, and at a port where nothing
    listens gave no hint; now it says which port the gateway is (from the running serve's record)."""
    from omnistage.common import run_record
    from omnistage.common.config import load_config

    cfg, override, address, admin = stage
    nowhere = f"127.0.0.1:{free_port()}"
    assert main(["generate", "--address", nowhere, "--prompt", "n=1", "--timeout-s", "5"]) == 1
    assert f"nothing answers at {nowhere}: is `omnistage serve` running" in capsys.readouterr().err
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["generate", "--address", admin, "--prompt", "n=1"]) == 1
    err = capsys.readouterr().err
    assert (
        "generate failed: UNIMPLEMENTED" in err
        and f"{admin} serves no omnistage.v1.Omni: a stage's port?" in err
    )
    record = run_record.RunRecord.of(load_config(cfg, [override]), cfg, [override], tmp_path)
    run_record.publish(record)
    try:
        assert main(["generate", "--address", admin, "--prompt", "n=1"]) == 1
        assert (
            f"{admin} serves no omnistage.v1.Omni: it is the admin port of front; the gateway of that "
            f"`serve` is at {address}" in capsys.readouterr().err
        )
    finally:
        run_record.withdraw(record)


def test_progress_in_a_log_is_plain_lines():
    """Issue 43.11: denoising progress written with `\\r` made one endless line in a log file."""
    import io

    from omnistage.common.cli.generate import _Progress

    log = io.StringIO()
    progress = _Progress(log)
    for step in range(1, 31):
        progress.update("imagegen", step, 30)
    progress.end()
    lines = log.getvalue().splitlines()
    assert "\r" not in log.getvalue() and lines[0] == "[imagegen 1/30]" and lines[-1] == "[imagegen 30/30]"
    assert len(lines) < 30, "at most a line a second besides the last"


def test_generate_error_exits_1_with_the_status(stage, capsys):
    cfg, override, _, _ = stage
    assert main(["generate", "--config", str(cfg), "--set", override, "--prompt", "invalid"]) == 1
    assert (
        "generate failed: INVALID_ARGUMENT: messages[0]: synthetic invalid request" in capsys.readouterr().err
    )


def test_ctrl_c_in_generate_exits_130_with_one_line(stage):
    cfg, override, _, _ = stage
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnistage.common.cli",
            "generate",
            "--config",
            str(cfg),
            "--set",
            override,
            "--prompt",
            "n=1000 delay=0.05",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    try:
        assert proc.stdout.read(3) == b"w0 "  # streaming has begun
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130
    assert err.decode().strip().splitlines() == ["omnistage: interrupted"]


def test_drain_and_resume_need_an_admin_port(stage, capsys):
    cfg, override, _, _ = stage
    assert (
        main(
            [
                "drain",
                "--config",
                str(cfg),
                "--set",
                override,
                "--set",
                "services.front.admin_port=0",
                "--service",
                "front",
            ]
        )
        == 2
    )
    assert (
        "services.front.admin_port: not set; Control (Drain, Resume) is served only there"
        in capsys.readouterr().err
    )
    assert main(["resume", "--config", str(cfg), "--service", "front"]) == 1  # it is not draining
    assert "resume failed: FAILED_PRECONDITION: front is not draining" in capsys.readouterr().err


def test_protos_check_is_clean_on_a_fresh_tree(capsys):
    assert main(["protos", "--check"]) == 0
    assert "up to date" in capsys.readouterr().out


def test_console_script_is_installed():
    script = Path(sys.executable).parent / "omnistage"
    if not script.exists():
        pytest.skip("console script not installed in this environment")
    result = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=60, env=dict(os.environ)
    )
    assert result.returncode == 0 and "serve" in result.stdout


def test_bench_refuses_bad_arguments_before_calling_anything(capsys):
    assert main(["bench", "--address", "127.0.0.1:1", "--kinds", "text,video"]) == 2
    assert "--kinds: a comma-separated list of text, vision, speech, image, mixed" in capsys.readouterr().err
    assert main(["bench", "--address", "127.0.0.1:1", "--concurrency", "0,2"]) == 2
    assert "--concurrency: expected positive integers" in capsys.readouterr().err


def test_generate_escapes_what_a_terminal_would_act_on(stage, capsys):
    cfg, override, _, _ = stage
    answer = "a\x1b[2Jb\x07c\x9b\nd\te\u202ef 你好\u3000👨\u200d👩"
    assert main(["generate", "--config", str(cfg), "--set", override, "--prompt", "echo " + answer]) == 0
    out = capsys.readouterr().out
    assert out.startswith("a\\x1b[2Jb\\x07c\\x9b\nd\te\\u202ef 你好\u3000👨\u200d👩\n")
    assert "\x1b" not in out and "\x07" not in out and "\u202e" not in out


def test_drain_prints_a_resume_command_that_works_as_printed(stage, capsys):
    """The resume command carries every `--set` flag drain was given, in order (here: the moved main port
    and a grace), so pasted as printed it reaches the same service."""
    cfg, override, _, _ = stage
    grace = "services.front.drain_grace_s=5"
    assert (
        main(
            [
                "drain",
                "--config",
                str(cfg),
                "--set",
                override,
                "--set",
                grace,
                "--service",
                "front",
                "--deadline-ms",
                "1000",
            ]
        )
        == 0
    )
    line = capsys.readouterr().out
    command = shlex.split(line.split("`")[1])
    assert command[:2] == ["omnistage", "resume"]
    assert command[2:] == ["--config", str(cfg), "--set", override, "--set", grace, "--service", "front"]
    assert main(command[1:]) == 0
    assert "front serving again" in capsys.readouterr().out


def test_bench_says_on_stderr_why_it_exits_1(stage, capsys):
    """The synthetic stage speaks no audio: every speech request is not done, and stderr says so."""
    cfg, override, _, _ = stage
    assert (
        main(
            [
                "bench",
                "--config",
                str(cfg),
                "--set",
                override,
                "--kinds",
                "text,speech",
                "--concurrency",
                "1",
                "--requests",
                "2",
                "--prompt",
                "n=2",
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert "omnistage bench: exit 1, requests that did not finish as asked" in err
    assert "  speech closed c=1: 2 of 2 not done: AUDIO_UNSPECIFIED 2" in err and "text closed" not in err
    assert (
        main(
            [
                "bench",
                "--config",
                str(cfg),
                "--set",
                override,
                "--kinds",
                "text",
                "--concurrency",
                "1",
                "--requests",
                "2",
                "--prompt",
                "n=2",
            ]
        )
        == 0
    )
    assert capsys.readouterr().err == ""


def test_commands_default_to_the_running_serve(stage, tmp_path, monkeypatch, capsys):
    """With this user's run record (what `serve` writes: config and `--set` overrides), `generate`,
    `status` and `drain`/`resume` need no --config and no repeated --set; a record whose `serve` has
    ended is not followed."""
    from omnistage.common import run_record
    from omnistage.common.config import load_config

    cfg, override, _, admin = stage
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert main(["status"]) == 2
    assert (
        "give --config FILE or --address HOST:PORT (no running `omnistage serve`" in capsys.readouterr().err
    )
    loaded = load_config(cfg, [override])
    record = run_record.RunRecord.of(loaded, cfg, [override], tmp_path)
    assert record.pid == os.getpid() and record.admin == {"front": admin}
    run_record.publish(record)
    assert stat.S_IMODE(run_record.record_path(os.getpid()).stat().st_mode) == 0o600
    assert main(["generate", "--prompt", "n=2"]) == 0
    assert capsys.readouterr().out.startswith("w0 w1 \n")
    assert main(["status"]) == 0 and f"front (gateway) admin {admin}: SERVING" in capsys.readouterr().out
    assert main(["drain", "--service", "front", "--deadline-ms", "100"]) == 0
    assert main(["resume", "--service", "front"]) == 0 and "front serving again" in capsys.readouterr().out
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])  # a second serve
    try:
        newer = dataclasses.replace(record, pid=other.pid, overrides=(), gateway="127.0.0.1:1")
        os.utime(run_record.publish(record), (1, 1))  # the first is the older one
        run_record.publish(newer)
        assert run_record.running() == [newer, record]
        # Issue 43.10: never the newest one silently; every command names both and asks.
        for argv in (
            ["status"],
            ["stage-key"],
            ["generate", "--prompt", "n=2"],
            ["drain", "--service", "front"],
        ):
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert "2 `omnistage serve` of this user are running; give --config FILE" in err, argv
            assert f"pid {other.pid}: --config {newer.config} (gateway 127.0.0.1:1)" in err
            assert f"pid {os.getpid()}: --config {record.config} --set {override}" in err
        assert main(["status", "--config", str(cfg), "--set", override]) == 0  # named: served
        run_record.withdraw(newer)  # it stopped: the one left is the default again
        assert main(["status"]) == 0 and run_record.running() == [record]
        capsys.readouterr()
    finally:
        other.kill()
        other.wait(timeout=60)
    run_record.withdraw(record)
    run_record.publish(dataclasses.replace(record, pid=_exited_pid()))
    assert run_record.running() == []  # a record a killed serve left
    assert main(["generate", "--prompt", "n=2"]) == 2


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


def test_serve_host_and_port_move_the_gateway_s_public_ports(stage, monkeypatch):
    import omnistage.common.launcher as launcher

    cfg, override, _, _ = stage
    seen = []
    monkeypatch.setattr(launcher, "launch", lambda path, overrides, **kw: seen.append(overrides) or 0)
    assert main(["serve", str(cfg), "--host", "0.0.0.0", "--port", "7000", "--http-port", "8000"]) == 0
    assert main(["serve", str(cfg), "--set", override]) == 0
    assert seen == [
        [
            "services.front.bind_host=0.0.0.0",
            "services.front.port=7000",
            "services.front.gateway.http_port=8000",
        ],
        [override],
    ]


def test_every_command_has_version(capsys):
    from omnistage.common.cli import build_parser
    from omnistage.common.runtime.control import omnistage_version

    commands = build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - every subcommand
    for argv in ([], *([c] for c in commands)):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--version"])
        assert exc.value.code == 0
        assert capsys.readouterr().out.strip() == f"omnistage {omnistage_version()}", argv


def test_a_reader_that_leaves_ends_the_command_quietly(stage, monkeypatch, capsys):
    """`omnistage status | head -1`: the reader is gone before anything is written (its end of the pipe
    closed first); the command ends 141 with nothing on stderr, no BrokenPipeError traceback."""
    _, _, _, admin = stage
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "w") as pipe:
        monkeypatch.setattr(sys, "stdout", pipe)
        assert main(["status", "--address", admin]) == 141
    assert capsys.readouterr().err == ""
