"""Test hook: an out-of-memory at one point of one rank's start-up (`services.<name>.fault` with `at`)."""

from __future__ import annotations

import torch
from omnistage.common.config import FaultConfig
from omnistage.common.log import get_logger
from omnistage.common.memory.device import DeviceMemory, SimulatedDeviceMemory
from omnistage.services.thinker.engine.model_runner import ModelRunner

log = get_logger(__name__)
_STEP_PREFIX = {"kv_rebuild": "rebuild", "kv_validation": "validate"}


class StartupFault:
    """Fires `fault` once on `rank` (inactive when the fault is not a start-up point of this rank)."""

    def __init__(self, fault: FaultConfig | None, rank: int) -> None:
        self.point = fault.at if fault is not None and fault.action == "oom" else ""
        if fault is not None and fault.rank not in (-1, rank):
            self.point = ""
        self.rank = rank
        self.fired = False

    def check_device(self, mem: DeviceMemory | None) -> None:
        """The KV points need a simulated device (they take its memory); refuse anything else early."""
        if self.point in _STEP_PREFIX and not isinstance(mem, SimulatedDeviceMemory):
            raise ValueError(
                f"fault.at {self.point}: needs memory.simulated_capacity_bytes (a simulated device)"
            )

    def on_step(self, phase: str, detail: str, runner: ModelRunner | None, mem: DeviceMemory | None) -> None:
        if not self.point or self.fired:
            return
        prefix = _STEP_PREFIX.get(self.point)
        if prefix is not None and phase == "profiling_memory" and detail.startswith(prefix):
            self.fired = True
            assert isinstance(mem, SimulatedDeviceMemory)
            free = max(0, mem.limit - mem.reserved() - mem.reserved_elsewhere())
            log.warning(
                "fault hook: a peer takes the %d free bytes of rank %d before %s", free, self.rank, prefix
            )
            mem.reserve(free, "fault hook")
        elif self.point == "warmup_forward" and phase == "warming_up" and runner is not None:
            self.fired = True
            log.warning("fault hook: rank %d raises out of memory inside warm-up shape %r", self.rank, detail)
            _raise_in_next_forward(runner, detail)


def _raise_in_next_forward(runner: ModelRunner, shape: str) -> None:
    layers = runner.model.attention_layers()
    handle = None

    def hook(module: torch.nn.Module, args: tuple) -> None:
        handle.remove()
        raise torch.OutOfMemoryError(f"injected out of memory (fault hook) in warm-up shape {shape!r}")

    handle = layers[len(layers) // 2].register_forward_pre_hook(hook)
