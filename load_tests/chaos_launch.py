"""Chaos launches of the real CPU pipeline: `omnistage serve` (thinker at TP 1 or 2 over gloo + gateway)
on the tiny checkpoint, many times, each with one fault chosen at random from a seed.

Faults are injected the product's own way (`services.<name>.fault`: hang, crash, oom or delay in one
start-up phase on one rank or all), plus three from outside: SIGTERM or SIGKILL to the launcher and
SIGKILL to one child (what the kernel's OOM killer does). Every launch must end SERVING (confirmed by
the harness's own health Check, then SIGTERM → exit 0), or exit non-zero with a report line naming
the faulty service, rank and phase, within the phase deadline + grace (wall clock: the deadline is the
product's promise), and leave no process and no /dev/shm segment behind.

The harness is honest about what it injected: whether a fault fired is read from the fault hook's log
line, and a fault that did not fire in a phase the service is known to enter is itself a failure.

    python load_tests/chaos_launch.py --launches 300 --seed 1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

INJECTED_PHASES = ("starting", "loading_weights", "profiling_memory", "warming_up")
ACTIONS = ("hang", "crash", "oom", "delay")
# Phases each process enters for sure today (others, e.g. profiling_memory, may come later: a fault
# there is judged by whether its hook fired). A fault here that never fires is a harness failure.
KNOWN_PHASES = {
    ("thinker", 0): ("starting", "loading_weights", "warming_up"),
    ("thinker", 1): ("starting", "loading_weights"),
    ("gateway", 0): ("starting", "warming_up"),
}
# What the report line of the faulty rank must say, per action.
CAUSE_TEXT = {
    "hang": "stuck",
    "crash": "exited with code 3",
    "oom": "SimulatedOOM",
    "sigkill": "killed by SIGKILL",
}
_FIRED_RE = re.compile(r"(\w+)\[r(\d+)\] WARNING fault hook action=(\w+) phase=(\w+)")
_STARTED_RE = re.compile(r"^omnistage: started (\S+) r(\d+) \(pid (\d+)\)$", re.M)


@dataclass(frozen=True)
class Settings:
    """Deadlines of the chaos deploy file and the harness's own margins (seconds)."""

    hang_deadline_s: float = 5.0  # deadline of the faulted phase
    # ... but `starting` runs from spawn and includes the imports (torch: seconds on 2 busy cores), and
    # a phase deadline holds for every service: a short one would fail healthy services.
    starting_hang_deadline_s: float = 12.0
    normal_deadline_s: float = 60.0  # every other phase: generous, so a loaded machine is not "stuck"
    heartbeat_timeout_s: float = 30.0
    poll_interval_s: float = 0.1
    stop_grace_s: float = 2.0
    drain_grace_s: float = 1.0
    slack_s: float = 5.0  # scheduling noise of 2 shared cores on top of every bound
    # The benchmark holds every diagnosis to its deadline + stop grace + slack; CI (a loaded 2-core
    # machine) checks only what happened and in what order, within launch_timeout_s, and the
    # times go to the table.
    timing_bounds: bool = True
    launch_timeout_s: float = 120.0  # the harness's hard limit: beyond it the launch counts as hung


@dataclass(frozen=True)
class Plan:
    """One launch: TP size and at most one fault."""

    index: int
    tp_size: int
    kind: str  # "none", an action of ACTIONS, "sigkill" (a child), "launcher_sigterm", "launcher_sigkill"
    service: str = ""
    phase: str = ""
    rank: int = -1
    delay_s: float = 0.0
    at_s: float = 0.0  # external signals: seconds after spawn

    def describe(self) -> str:
        if self.kind in ACTIONS:
            return f"{self.kind} {self.service} r{self.rank if self.rank >= 0 else '*'} {self.phase}"
        if self.kind == "sigkill":
            return f"SIGKILL a child at {self.at_s:.1f}s"
        if self.kind.startswith("launcher_"):
            return f"{self.kind.removeprefix('launcher_').upper()} launcher at {self.at_s:.1f}s"
        return "no fault"


@dataclass
class Result:
    plan: Plan
    expected: str = ""  # serving | failed | stopped | killed
    outcome: str = ""  # serving | failed | stopped | killed | hung
    exit_code: int | None = None
    fired: list[int] = field(default_factory=list)
    diagnose_s: float | None = None  # fault → launcher exit
    bound_s: float | None = None
    wall_s: float = 0.0
    leftovers: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # The faulty rank was named only inside another rank's line ("thinker r1 ... failed: rank 0 failed
    # in ..."), not by a line of its own: acceptable, but weaker; counted in the summary.
    indirect: bool = False
    log_tail: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems


def plan_launches(n: int, seed: int, tp_sizes: tuple[int, ...] = (1, 2)) -> list[Plan]:
    """`n` launches from `seed`: ~10% no fault, ~10% outside signals, the rest fault-hook faults."""
    rng = random.Random(seed)
    plans = []
    for i in range(n):
        tp = rng.choice(tp_sizes)
        roll = rng.random()
        if roll < 0.10:
            plans.append(Plan(i, tp, "none"))
        elif roll < 0.20:
            kind = rng.choice(("sigkill", "launcher_sigterm", "launcher_sigkill"))
            plans.append(Plan(i, tp, kind, at_s=round(rng.uniform(0.5, 5.0), 2)))
        else:
            service = rng.choice(("thinker", "thinker", "gateway"))
            rank = rng.choice((-1, *range(tp))) if service == "thinker" else rng.choice((-1, 0))
            action = rng.choice(ACTIONS)
            delay = round(rng.uniform(0.2, 1.0), 2) if action == "delay" else 0.0
            # Mostly phases the target enters; some it may not (judged by whether the hook fired).
            known = KNOWN_PHASES[(service, min(max(rank, 0), 1))]
            phase = rng.choice(known if rng.random() < 0.8 else INJECTED_PHASES)
            plans.append(Plan(i, tp, action, service, phase, rank, delay))
    return plans


def hang_deadline(phase: str, settings: Settings) -> float:
    return settings.starting_hang_deadline_s if phase == "starting" else settings.hang_deadline_s


# Every port `free_ports` handed out in this process: never handed out twice. Each call's ports are
# held at once while picked, but the kernel picks a random free port for each bind: two calls for one
# config (its service port, then its admin port) could get the same one.
_HANDED_OUT: set[int] = set()


def free_ports(n: int, attempts: int = 1000) -> list[int]:
    """`n` distinct ports free now, held at once while picked, none handed out before in this process
    (the one owner of the tests' free ports)."""
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            if len(socks) >= n + attempts:
                raise RuntimeError(f"no {n} free ports not handed out before after {len(socks)} binds")
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            if port not in _HANDED_OUT and port not in ports:
                ports.append(port)
        _HANDED_OUT.update(ports)
        return ports
    finally:
        for s in socks:
            s.close()


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections and `bind(0)` (32768 where it is not said)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_block(n: int, attempts: int = 200) -> int:
    """The first of `n` consecutive ports free now (a thinker's `dist_port`: one port a TP rank), held at once
    while picked. Below the ephemeral range: there a client connection's local port can take `base + 1`
    between the pick and the rank's bind (CI, 2026-11-29: `dist_port+1 ... is in use`)."""
    high = _ephemeral_low() - n
    for base in random.Random().sample(range(10000, high), attempts):
        socks = [socket.socket() for _ in range(n)]
        try:
            for port, s in zip(range(base, base + n), socks, strict=True):
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports in 10000..{high} after {attempts} tries")


def deploy_config(plan: Plan, ckpt: Path, settings: Settings) -> dict:
    gw_port, th_port = free_ports(2)
    dist_port = free_port_block(plan.tp_size)
    deadlines = {
        p: settings.normal_deadline_s
        for p in ("starting", "loading_weights", "profiling_memory", "warming_up", "capturing_graphs")
    }
    thinker: dict = {
        "kind": "thinker",
        "port": th_port,
        "tp_size": plan.tp_size,
        "dist_port": dist_port,
        "drain_grace_s": settings.drain_grace_s,
        "engine": {
            "max_num_seqs": 4,
            "max_num_batched_tokens": 64,
            "max_model_len": 128,
            "default_max_tokens": 8,
        },
    }
    gateway: dict = {
        "kind": "gateway",
        "port": gw_port,
        "drain_grace_s": settings.drain_grace_s,
        "gateway": {"stage_wait_s": 30.0},
    }
    if plan.kind in ACTIONS:
        if plan.kind == "hang":  # (the deadline is per phase, for every service: only where it is needed)
            deadlines[plan.phase] = hang_deadline(plan.phase, settings)
        fault = {"phase": plan.phase, "action": plan.kind, "rank": plan.rank, "delay_s": plan.delay_s}
        (thinker if plan.service == "thinker" else gateway)["fault"] = fault
    return {
        "model": {"checkpoint": str(ckpt)},
        "startup": {
            "phase_deadlines_s": deadlines,
            "heartbeat_timeout_s": settings.heartbeat_timeout_s,
            "poll_interval_s": settings.poll_interval_s,
            "stop_grace_s": settings.stop_grace_s,
        },
        "services": {"thinker": thinker, "gateway": gateway},
    }


# -- processes ---------------------------------------------------------------------------------


def alive(pid: int) -> bool:
    """Running; a zombie counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def pgrep(pattern: str) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True, timeout=10).stdout
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return []
    return [int(p) for p in out.split() if int(p) != os.getpid() and alive(int(p))]


def shm_segments(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        names += [p.name for p in Path("/dev/shm").glob(f"omnistage-{pid}-*")]
    return names


def leftovers(pids: list[int], cfg_path: Path, timeout_s: float) -> list[str]:
    """Processes and shm segments of this launch still there after `timeout_s` (then removed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = sorted({p for p in pids if alive(p)} | set(pgrep(str(cfg_path))))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    found = [f"pid {p}" for p in left] + [f"/dev/shm/{n}" for n in shm_segments(pids)]
    for p in left:  # never leave them to the next launch
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(p, signal.SIGKILL)
    for name in shm_segments(pids):
        Path("/dev/shm", name).unlink(missing_ok=True)
    return found


def started_children(out: str) -> dict[tuple[str, int], int]:
    return {(m[1], int(m[2])): int(m[3]) for m in _STARTED_RE.finditer(out)}


def fired_ranks(err: str, plan: Plan) -> list[int]:
    return sorted(
        {
            int(m[2])
            for m in _FIRED_RE.finditer(err)
            if m[1] == plan.service and m[3] == plan.kind and m[4] == plan.phase
        }
    )


def watch_fault(run_dir: Path, plan: Plan, seen: dict[int, float]) -> None:
    """Record in `seen` when each rank of the faulty service entered the faulted phase (its own status
    file's clock; for a failure there, the failure time). Called while the launch runs: a rank that
    stops gracefully later overwrites its file."""
    if plan.kind not in ACTIONS:
        return
    for path in run_dir.glob(f"{plan.service}.r*.json"):
        try:
            rec = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        rank = rec.get("rank", -1)
        if rank in seen:
            continue
        if rec.get("phase") == plan.phase:
            seen[rank] = rec["phase_started_unix"]
        elif rec.get("phase") == "failed" and rec.get("failed_in") == plan.phase:
            seen[rank] = rec["heartbeat_unix"]


def _healthy(address: str, timeout_s: float) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


# -- one launch ----------------------------------------------------------------------------------


def run_launch(plan: Plan, ckpt: Path, workdir: Path, settings: Settings = Settings()) -> Result:
    """Launch, inject, wait for the end, and judge it (never raises for a product failure)."""
    res = Result(plan)
    tmp = Path(tempfile.mkdtemp(prefix=f"chaos-{plan.index}-", dir=workdir))
    cfg_path, run_dir, ready = tmp / "deploy.yaml", tmp / "run", tmp / "ready"
    cfg_path.write_text(yaml.safe_dump(deploy_config(plan, ckpt, settings)))
    out_path, err_path = tmp / "out.txt", tmp / "err.txt"
    rng = random.Random(plan.index)
    signal_at = (
        time.monotonic() + plan.at_s
        if plan.kind in ("sigkill", "launcher_sigterm", "launcher_sigkill")
        else None
    )
    killed_label = ""
    t0 = time.monotonic()
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "omnistage.common.cli",
                "serve",
                str(cfg_path),
                "--run-dir",
                str(run_dir),
                "--ready-file",
                str(ready),
            ],
            stdout=out,
            stderr=err,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            start_new_session=True,
        )
    hard_deadline = t0 + settings.launch_timeout_s
    serving = False
    entered: dict[int, float] = {}
    while proc.poll() is None and time.monotonic() < hard_deadline:
        watch_fault(run_dir, plan, entered)
        if signal_at is not None and time.monotonic() >= signal_at:
            signal_at = None
            if plan.kind == "sigkill":
                children = started_children(out_path.read_text())
                if children:
                    (svc, rank), pid = rng.choice(sorted(children.items()))
                    killed_label = f"{svc} r{rank}"
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            else:
                proc.send_signal(signal.SIGTERM if plan.kind == "launcher_sigterm" else signal.SIGKILL)
        if not serving and ready.exists() and ready.read_text().strip():
            serving = True
            if not _healthy(ready.read_text().strip(), 5.0):
                res.problems.append("ready file written but the gateway's health is not SERVING")
            # The launch is complete: stop it; unless a child was just SIGKILLed, when the launcher
            # must notice and fail by itself (a SIGTERM racing that death would hide it).
            if signal_at is None and not killed_label:
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
    if proc.poll() is None:
        res.outcome = "hung"
        res.problems.append(f"launcher still running {settings.launch_timeout_s:g}s after spawn")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    t_exit = time.time()
    watch_fault(run_dir, plan, entered)
    res.wall_s = time.monotonic() - t0
    res.exit_code = proc.returncode
    out_text, err_text = out_path.read_text(), err_path.read_text()
    children = started_children(out_text)
    res.log_tail = "\n".join((out_text + err_text).splitlines()[-40:])
    if ("cannot bind" in err_text and "in use" in err_text) or " is in use (" in err_text:
        res.outcome = "port-collision"  # another process took a free port: environment, not product
    elif not res.outcome:
        res.outcome = _outcome(proc.returncode, serving)
    _judge(res, plan, err_text, killed_label, entered, t_exit, settings)
    # After a SIGKILLed launcher the children leave through their watchdog (drain grace + 5 s).
    wait = settings.drain_grace_s + 5.0 + settings.slack_s if plan.kind == "launcher_sigkill" else 3.0
    res.leftovers = leftovers(list(children.values()), cfg_path, wait)
    if res.leftovers:
        res.problems.append(f"left behind: {', '.join(res.leftovers)}")
    if res.ok:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        res.log_tail += f"\n(logs kept in {tmp})"
    return res


def _outcome(code: int, serving: bool) -> str:
    if code == -signal.SIGKILL:
        return "killed"
    if code == 0:
        return "serving" if serving else "stopped"
    return "failed"


def _judge(
    res: Result, plan: Plan, err: str, killed: str, entered: dict[int, float], t_exit: float, s: Settings
) -> None:
    """Set `expected` and add a problem for every broken promise."""
    if res.outcome in ("hung", "port-collision"):
        res.expected = "?"
        return
    if plan.kind in ("launcher_sigterm", "launcher_sigkill"):
        res.expected = "stopped" if plan.kind == "launcher_sigterm" else "killed"
        if res.outcome == "serving" and plan.kind == "launcher_sigterm":  # the signal came after ready
            res.expected = "serving"
        if res.outcome != res.expected:
            res.problems.append(f"expected {res.expected}, got {res.outcome} (exit {res.exit_code})")
        return
    if plan.kind == "sigkill":
        res.expected = "failed" if killed else "serving"
        if res.outcome != res.expected:
            res.problems.append(
                f"expected {res.expected} after SIGKILL of {killed or 'nothing'}, got {res.outcome}"
            )
        elif killed and not _names(err, [killed], "", CAUSE_TEXT["sigkill"]):
            res.problems.append(f"no report line names {killed} and 'killed by SIGKILL'")
        return
    if plan.kind not in ACTIONS:
        res.expected = "serving"
        if res.outcome != "serving":
            res.problems.append(f"expected serving, got {res.outcome} (exit {res.exit_code})")
        return
    res.fired = fired_ranks(err, plan)
    ranks = [plan.rank] if plan.rank >= 0 else list(range(plan.tp_size if plan.service == "thinker" else 1))
    enters = [r for r in ranks if plan.phase in KNOWN_PHASES[(plan.service, min(r, 1))]]
    # A delay must fire on every rank that enters the phase; a failure on at least one (the first
    # failing rank may get the others stopped before they reach the phase).
    missing = (
        [r for r in enters if r not in res.fired]
        if plan.kind == "delay"
        else (enters if enters and not res.fired else [])
    )
    if missing:
        res.problems.append(
            f"fault did not fire on {plan.service} r{missing} in {plan.phase}, a phase it enters"
        )
    res.expected = "failed" if res.fired and plan.kind != "delay" else "serving"
    if res.outcome != res.expected:
        res.problems.append(f"expected {res.expected}, got {res.outcome} (exit {res.exit_code})")
        return
    if res.expected != "failed":
        return
    if "omnistage: start-up failed:" not in err:
        res.problems.append("no 'start-up failed' headline")
    labels = [f"{plan.service} r{r}" for r in res.fired]
    if not _names(err, labels, plan.phase, CAUSE_TEXT[plan.kind]):
        res.indirect = _names_indirectly(err, plan, res.fired)
        if not res.indirect:
            res.problems.append(
                f"no report line names {'/'.join(labels)} {plan.phase} and {CAUSE_TEXT[plan.kind]!r}"
            )
    times = [entered[r] for r in res.fired if r in entered]
    fired_at = min(times) if times else None
    if fired_at is None:
        res.problems.append("no status file shows when the fault fired")
        return
    res.diagnose_s = t_exit - fired_at
    if res.diagnose_s < 0:
        res.problems.append(f"the launcher exited {-res.diagnose_s:.1f}s before the fault fired")
    wait = hang_deadline(plan.phase, s) + s.poll_interval_s if plan.kind == "hang" else 0.0
    res.bound_s = wait + s.stop_grace_s + s.slack_s
    if s.timing_bounds and res.diagnose_s > res.bound_s:
        res.problems.append(
            f"took {res.diagnose_s:.1f}s from the fault to the exit (bound {res.bound_s:.1f}s)"
        )


def _names_indirectly(err: str, plan: Plan, ranks: list[int]) -> bool:
    """Another rank's report line carries the TP group's first failure: `rank K failed in ...` + cause."""
    return any(
        line.startswith(plan.service + " r")
        and f"rank {r} failed in" in line
        and plan.phase in line
        and CAUSE_TEXT[plan.kind] in line
        for line in err.splitlines()
        for r in ranks
    )


def _names(err: str, labels: list[str], phase: str, cause: str) -> bool:
    """A report line `<label> <phase> ... <cause>` for one of `labels`."""
    return any(
        line.startswith(label + " ") and phase in line and cause in line
        for line in err.splitlines()
        for label in labels
    )


# -- many launches -------------------------------------------------------------------------------


def run_chaos(
    plans: list[Plan], ckpt: Path, workdir: Path, settings: Settings = Settings(), log=print
) -> list[Result]:
    results = []
    for plan in plans:
        for _ in range(3):  # a port taken by a stranger between our bind test and the service's bind
            res = run_launch(plan, ckpt, workdir, settings)
            if res.outcome != "port-collision":
                break
        results.append(res)
        mark = ("ok*" if res.indirect else "ok ") if res.ok else "BAD"
        diag = f" diagnosed in {res.diagnose_s:.1f}s" if res.diagnose_s is not None else ""
        log(
            f"[{mark}] #{plan.index:<3} tp{plan.tp_size} {plan.describe():<40} -> {res.outcome:<8}"
            f" exit {res.exit_code} ({res.wall_s:.1f}s){diag}"
        )
        for p in res.problems:
            log(f"      problem: {p}")
        if not res.ok:
            log("      " + res.log_tail.replace("\n", "\n      "))
    return results


def summary(results: list[Result]) -> str:
    """The table of a chaos run: outcomes by fault kind, max time to diagnose, leftovers, problems."""
    by_kind: dict[str, Counter] = defaultdict(Counter)
    diag: dict[str, float] = {}
    for r in results:
        kind = (
            r.plan.kind
            if r.plan.kind not in ACTIONS or r.fired or r.plan.kind == "delay"
            else (f"{r.plan.kind} (not entered)")
        )
        by_kind[kind][r.outcome] += 1
        by_kind[kind]["BAD" if not r.ok else "ok"] += 1
        by_kind[kind]["indirect"] += r.indirect
        if r.diagnose_s is not None:
            diag[kind] = max(diag.get(kind, 0.0), r.diagnose_s)
    outcomes = ["serving", "failed", "stopped", "killed", "hung", "port-collision"]
    lines = [
        f"{'fault kind':<24}{'launches':>9}"
        + "".join(f"{o:>10}" for o in outcomes[:5])
        + f"{'ok':>6}{'BAD':>6}{'indirect':>9}{'max diag s':>12}"
    ]
    for kind in sorted(by_kind):
        c = by_kind[kind]
        n = c["ok"] + c["BAD"]
        lines.append(
            f"{kind:<24}{n:>9}"
            + "".join(f"{c[o]:>10}" for o in outcomes[:5])
            + f"{c['ok']:>6}{c['BAD']:>6}{c['indirect']:>9}"
            + (f"{diag[kind]:>12.1f}" if kind in diag else f"{'-':>12}")
        )
    bad = [r for r in results if not r.ok]
    left = sum(len(r.leftovers) for r in results)
    lines.append(
        f"launches {len(results)}, ok {len(results) - len(bad)}, BAD {len(bad)}, "
        f"max time to diagnose {max(diag.values(), default=0.0):.1f}s, leftovers {left}, "
        f"wall {sum(r.wall_s for r in results):.0f}s"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", default="1,2", help="TP sizes to draw from")
    p.add_argument("--ckpt", default=None, help="tiny checkpoint dir (default: written to a temp dir)")
    p.add_argument("--hang-deadline", type=float, default=Settings.hang_deadline_s)
    p.add_argument("--only", type=int, nargs="*", default=None, help="run only these launch indices")
    args = p.parse_args(argv)
    settings = Settings(hang_deadline_s=args.hang_deadline)
    workdir = Path(tempfile.mkdtemp(prefix="omnistage-chaos-"))
    ckpt = Path(args.ckpt) if args.ckpt else None
    if ckpt is None:
        from omnistage.common.checkpoint.tiny import write_tiny_checkpoint

        ckpt = write_tiny_checkpoint(workdir / "ckpt", seed=0)
    plans = plan_launches(args.launches, args.seed, tuple(int(t) for t in args.tp.split(",")))
    if args.only is not None:
        plans = [p for p in plans if p.index in args.only]
    results = run_chaos(plans, ckpt, workdir, settings)
    print(summary(results))
    ok = all(r.ok for r in results)
    if ok:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs of the BAD launches are kept in {workdir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
