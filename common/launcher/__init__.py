"""`omnistage serve`: start every service of a deploy file as child processes, wait until each is
ready (every wait with a deadline, a failure named by stage, rank and phase), then supervise them:
`spawn` (processes), `watch` (start-up), `supervise` (restarts), `run` (`Launcher`), `serve` (`launch`)."""

from omnistage.common.launcher.children import Child, Group, exit_cause
from omnistage.common.launcher.run import Launcher
from omnistage.common.launcher.serve import launch
from omnistage.common.launcher.watch import stuck_cause
from omnistage.common.stages import MODULES

__all__ = ["MODULES", "Child", "Group", "Launcher", "exit_cause", "launch", "stuck_cause"]
