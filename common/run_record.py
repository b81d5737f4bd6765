"""The record of a running `omnistage serve`: what the other commands need to reach it without repeating
its flags."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from omnistage.common.config import DeployConfig, join_host_port
from omnistage.common.pids import pid_alive
from omnistage.common.runtime import auth

RUN_FILE = "run.json"
RUNS_DIR = "runs"


@dataclass(frozen=True)
class RunRecord:
    """One `serve`: what it runs and where its ports are (never a key)."""

    config: str  # the deploy file, absolute
    overrides: tuple[str, ...]
    run_dir: str
    pid: int
    gateway: str = ""  # HOST:PORT of the public gRPC API ('' without a gateway)
    http: str = ""  # HOST:PORT of the OpenAI-compatible HTTP front ('' when off)
    admin: dict[str, str] = field(default_factory=dict)  # service → its admin HOST:PORT

    @classmethod
    def of(
        cls, cfg: DeployConfig, cfg_path: str | Path, overrides: Sequence[str], run_dir: Path
    ) -> RunRecord:
        gateways = cfg.services_of("gateway")
        gw = gateways[0] if gateways else None
        http = ""
        if gw is not None and gw.gateway.http_port:
            http = join_host_port(cfg.dial_host(gw.bind_host), gw.gateway.http_port)
        return cls(
            str(Path(cfg_path).resolve()),
            tuple(overrides),
            str(run_dir),
            os.getpid(),
            cfg.address(gw.name) if gw is not None else "",
            http,
            {name: cfg.admin_address(name) for name in cfg.services if cfg.admin_address(name)},
        )

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "overrides": list(self.overrides)}, indent=1) + "\n"


def record_path(pid: int) -> Path:
    return auth.user_dir() / RUNS_DIR / f"{pid}.json"


def publish(record: RunRecord) -> Path:
    """Write the record in its run directory and among this user's running deployments; the latter's path."""
    text = record.to_json()
    Path(record.run_dir, RUN_FILE).write_text(text)
    auth.private_dir(auth.user_dir())
    return auth.write_private(record_path(record.pid), text)


def withdraw(record: RunRecord) -> None:
    """Remove the record of this user's running deployments (the run directory keeps its copy)."""
    with contextlib.suppress(OSError):
        record_path(record.pid).unlink()


def running() -> list[RunRecord]:
    """This user's running `serve`s, newest first (records not this user's, or whose process is gone,
    are left out)."""
    runs: list[tuple[float, RunRecord]] = []
    with contextlib.suppress(OSError):
        for path in (auth.user_dir() / RUNS_DIR).glob("*.json"):
            record = _read(path)
            if record is not None and pid_alive(record.pid):
                runs.append((path.stat().st_mtime, record))
    return [record for _, record in sorted(runs, key=lambda r: r[0], reverse=True)]


def describe(record: RunRecord) -> str:
    """`pid 123: --config /abs/a.yaml --set k=v (gateway 127.0.0.1:7100)`: what tells one serve from another."""
    sets = "".join(f" --set {o}" for o in record.overrides)
    return f"pid {record.pid}: --config {record.config}{sets}" + (
        f" (gateway {record.gateway})" if record.gateway else ""
    )


def with_address(address: str) -> RunRecord | None:
    """The running `serve` one of whose ports is `address`; the only one running when none says so."""
    runs = running()
    owners = [r for r in runs if address in (r.gateway, r.http, *r.admin.values())]
    if len(owners) == 1:
        return owners[0]
    return runs[0] if len(runs) == 1 and not owners else None


def _read(path: Path) -> RunRecord | None:
    try:
        if path.stat().st_uid != os.getuid():
            return None
        data = json.loads(path.read_text())
        return RunRecord(**{**data, "overrides": tuple(data["overrides"])})
    except (OSError, ValueError, TypeError, KeyError):
        return None
