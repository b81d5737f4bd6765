"""TP ranks 1..N-1 after start-up: "receive plan -> run" until the exit plan.

A worker never decides anything. When it fails it reports to the group's store and leaves; its
PeerWatch (and every other rank's) ends the group within `tp.failure_exit_s`. (Spawning ranks
without the launcher, for tests and benchmarks, is `tests/services/thinker/group/local_ranks.py`.)
"""

from __future__ import annotations

from omnistage.common.log import get_logger
from omnistage.services.thinker.engine.model_runner import ModelRunner
from omnistage.services.thinker.group.startup import StartedRank
from omnistage.services.thinker.tp.distributed import TPControl, TPError
from omnistage.services.thinker.tp.plan import PlanKind

log = get_logger(__name__)


def serve_plans(control: TPControl, runner: ModelRunner) -> int:
    """Execute rank 0's plans until the exit plan; returns the number of plans run. A failed forward
    is reported to the group (TPError naming the group's first failure)."""
    num_run = 0
    while True:
        plan = control.broadcast_plan()
        if plan.kind is PlanKind.EXIT:
            return num_run
        if plan.kind is PlanKind.RUN:
            try:
                runner.execute(plan)
                if plan.share_sampled:
                    runner.share_sampled(plan)
            except Exception as exc:
                raise TPError(control.fail(f"step {control.num_plans - 1} forward", exc)) from exc
            num_run += 1


def run_plan_loop(started: StartedRank) -> int:
    """A started worker's life until the exit plan; leaves the group on the way out."""
    num_run = serve_plans(started.control, started.runner)
    log.info("worker rank %d leaves after %d steps", started.cfg.rank, num_run)
    started.control.close()
    return num_run
