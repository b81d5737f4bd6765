import fcntl
import os
import signal
import stat
import subprocess
import sys
import time

import pytest
from omnistage.common.transport import sweep_stale_segments
from omnistage.common.transport.host import SHM_DIR, pid_alive

from tests.common.transport.producers import Producer

# The zombie test's producer: a child of this process (so it stays a zombie until reaped here).
PRODUCER = """
import sys
from omnistage.common.transport.shm_pool import ShmPool
pool = ShmPool(1 << 16)
print(pool.name, flush=True)
sys.stdin.readline()
"""


def _start_producer():
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    name = proc.stdout.readline().strip()  # the child exits (EOF) if it fails, so this cannot hang
    assert name.startswith(f"omnistage-{proc.pid}-"), f"producer did not report its segment: {name!r}"
    return proc, os.path.join(SHM_DIR, name)


def _pool_producer() -> tuple[Producer, str]:
    producer = Producer("pool")
    assert producer.name.startswith(f"omnistage-{producer.pid}-"), producer.name
    return producer, os.path.join(SHM_DIR, producer.name)


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=60)
    return proc.pid


@pytest.fixture
def producers():
    procs = []
    yield procs
    for proc in procs:
        if isinstance(proc, Producer):
            proc.stop()
            continue
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)


def test_sweep_removes_a_killed_producers_segment_only(producers):
    dead, dead_path = _pool_producer()
    live, live_path = _pool_producer()
    producers += [dead, live]
    assert stat.S_IMODE(os.stat(dead_path).st_mode) == 0o600
    os.kill(dead.pid, signal.SIGKILL)
    dead.wait()
    assert os.path.exists(dead_path)  # a SIGKILLed owner cannot clean up

    removed = sweep_stale_segments()
    assert os.path.basename(dead_path) in removed and not os.path.exists(dead_path)
    assert os.path.basename(live_path) not in removed and os.path.exists(live_path)

    live.tell()
    assert live.said() == "closed"
    assert live.wait() == 0
    assert not os.path.exists(live_path)  # the owner unlinks on close


def test_a_zombie_owner_counts_as_dead(producers):
    proc, path = _start_producer()
    producers.append(proc)
    os.kill(proc.pid, signal.SIGKILL)
    # not reaped yet: until proc.wait() the pid is a zombie, which kill(pid, 0) still reports
    deadline = time.monotonic() + 30
    while pid_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not pid_alive(proc.pid), f"SIGKILLed pid {proc.pid} still looks alive after 30 s"
    assert os.path.exists(f"/proc/{proc.pid}")  # still a zombie: we have not reaped it
    # the leader turns zombie before its other threads have closed the files (and dropped the flock)
    removed = sweep_stale_segments()
    while os.path.basename(path) not in removed and time.monotonic() < deadline:
        time.sleep(0.01)
        removed = sweep_stale_segments()
    assert os.path.basename(path) in removed


def test_sweep_keeps_a_segment_whose_lock_is_held():
    """A live owner in another PID namespace may have a pid that looks dead here: its flock protects it."""
    path = os.path.join(SHM_DIR, f"omnistage-{_dead_pid()}-{'ab' * 8}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert os.path.basename(path) not in sweep_stale_segments()
        assert os.path.exists(path)
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert os.path.basename(path) in sweep_stale_segments()
    finally:
        os.close(fd)
        if os.path.exists(path):
            os.unlink(path)


def test_sweep_ignores_other_files():
    path = os.path.join(SHM_DIR, f"omnistage-notes-{os.getpid()}")
    open(path, "w").close()
    try:
        assert os.path.basename(path) not in sweep_stale_segments()
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_a_sweep_for_given_owners_leaves_other_dead_owners_segments(producers):
    """The launcher's clean-up at stop removes its own children's segments, nobody else's."""
    mine, mine_path = _pool_producer()
    other, other_path = _pool_producer()
    producers += [mine, other]
    for proc in (mine, other):
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    try:
        removed = sweep_stale_segments(owners={mine.pid})
        assert removed == [os.path.basename(mine_path)] and not os.path.exists(mine_path)
        assert os.path.exists(other_path)
    finally:
        sweep_stale_segments(owners={other.pid})
