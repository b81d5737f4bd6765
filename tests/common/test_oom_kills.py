"""A SIGKILL is called out of memory only when the kernel's OOM killer's count rose."""

from __future__ import annotations

import signal

import pytest
from omnistage.common import oom_kills
from omnistage.common.launcher import exit_cause


@pytest.fixture
def fake_system(tmp_path, monkeypatch):
    """A cgroup tree and /proc of our own: returns a function that sets the cgroup v1 oom_kill count."""
    group = tmp_path / "cgroup" / "memory" / "pod" / "c1"
    group.mkdir(parents=True)
    (tmp_path / "self_cgroup").write_text("9:pids:/\n4:memory:/pod/c1\n0::/\n")
    (tmp_path / "vmstat").write_text("pgfault 10\noom_kill 7\n")
    monkeypatch.setattr(oom_kills, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(oom_kills, "PROC_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(oom_kills, "VMSTAT", tmp_path / "vmstat")

    def set_count(n: int) -> None:
        (group / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {n}\n")

    return set_count


def test_a_sigkill_is_out_of_memory_only_when_the_oom_killer_did_it(fake_system):
    fake_system(2)
    before = oom_kills.oom_kill_count()
    assert before == 2  # the container's count, not the host's (7)
    assert exit_cause(-signal.SIGKILL, None, before) == "killed by SIGKILL"  # someone's kill -9
    fake_system(3)
    assert exit_cause(-signal.SIGKILL, None, before) == (
        "killed by SIGKILL (out of memory: the kernel's OOM killer ended it; see dmesg)"
    )
    assert exit_cause(-signal.SIGTERM, None, before) == "killed by SIGTERM"


def test_cgroup_v2_and_the_hosts_count_are_read_too(tmp_path, monkeypatch):
    (tmp_path / "cgroup" / "svc").mkdir(parents=True)
    (tmp_path / "cgroup" / "svc" / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n")
    (tmp_path / "self_cgroup").write_text("0::/svc\n")
    (tmp_path / "vmstat").write_text("oom_kill 9\n")
    monkeypatch.setattr(oom_kills, "CGROUP_ROOT", tmp_path / "cgroup")
    monkeypatch.setattr(oom_kills, "PROC_CGROUP", tmp_path / "self_cgroup")
    monkeypatch.setattr(oom_kills, "VMSTAT", tmp_path / "vmstat")
    assert oom_kills.oom_kill_count() == 1
    (tmp_path / "self_cgroup").write_text("0::/gone\n")
    assert oom_kills.oom_kill_count() == 9  # no readable cgroup counter: the host's
    assert not oom_kills.oom_killed_since(None)  # unknown before: never called out of memory
