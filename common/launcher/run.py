"""`Launcher`: one run of a deploy file: the MPS daemon, every service side by side, ready, supervised,
stopped."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from omnistage.common import mps
from omnistage.common.launcher.supervise import Supervisor


class Launcher(Supervisor):
    """Starts the services of one deploy file side by side (the gateway too) and supervises them:
    a service that dies or hangs after ready is restarted with backoff until its budget is spent."""

    def ready_address(self) -> str:
        gateways = self.cfg.services_of("gateway")
        first = gateways[0] if gateways else next(iter(self.cfg.services.values()))
        child = next(c for c in self.children if c.svc.name == first.name and c.rank == 0)
        return (child.status.address if child.status else "") or self.cfg.address(first.name)

    def run(self, ready_file: Path | None, exit_after_ready: bool) -> int:
        # Every service side by side, the gateway too: it serves text as soon as the thinker is
        # admitted and each other capability when its stage is; ready = every capability ready.
        try:
            if self.stop_signal is not None:  # asked before anything started: nothing to stop
                self.say(f"omnistage: {signal.Signals(self.stop_signal).name} before start-up, stopping")
                return 0
            if not self.start_mps():
                return 1
            culprit = self.wait_serving(self.start_groups(list(self.cfg.services.values())))
            if culprit is not None:
                self.report(f"start-up failed: {culprit.label} {culprit.cause}", culprit)
                return 1
            if self.stop_signal is not None:
                self.say(f"omnistage: {signal.Signals(self.stop_signal).name} during start-up, stopping")
                return 0
            address = self.ready_address()
            what = "gateway" if self.cfg.services_of("gateway") else "services"
            self.say(f"omnistage: ready in {time.monotonic() - self.started:.1f}s, {what} at {address}")
            if ready_file is not None:
                _write_atomic(ready_file, address + "\n")
            if exit_after_ready:
                return 0
            return self.supervise()
        finally:
            self.stop_all()
            self.say("omnistage: all services stopped")
            self.stop_mps()

    def start_mps(self) -> bool:
        """The CUDA MPS daemon, where the deploy file wants one (common/mps.py), before any stage
        starts; False when `devices.mps.mode: on` and it could not start (the start fails)."""
        if not mps.wanted(self.cfg):
            return True
        mode = self.cfg.devices.mps.mode
        daemon = mps.MpsDaemon(self.cfg.devices.mps, self.run_dir)
        try:
            daemon.start()
        except mps.MpsError as exc:
            if mode == "on":
                self.say(
                    f"omnistage: start-up failed: CUDA MPS (devices.mps.mode: on) did not start: {exc}",
                    self.err,
                )
                return False
            self.say(
                f"omnistage: warning: CUDA MPS did not start, the stages that share a GPU will time-slice "
                f"it (devices.mps.mode: auto; 'off' silences this): {exc}",
                self.err,
            )
            return True
        self.mps = daemon
        shared = "; ".join(f"GPU {g}: {', '.join(n)}" for g, n in mps.shared_gpus(self.cfg).items())
        assert daemon.proc is not None
        self.say(
            f"omnistage: CUDA MPS control daemon started (pid {daemon.proc.pid}, pipe {daemon.pipe_dir})"
            + (f" for {shared}" if shared else "")
        )
        return True

    def stop_mps(self) -> None:
        """Stop this run's MPS daemon, after every stage (its clients) has gone."""
        if self.mps is None:
            return
        problem = self.mps.stop()
        self.mps = None
        if problem:
            self.say(f"omnistage: warning: CUDA MPS control daemon: {problem}", self.err)
        else:
            self.say("omnistage: CUDA MPS control daemon stopped")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
