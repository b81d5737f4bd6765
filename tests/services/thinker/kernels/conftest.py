"""The thinker's Triton kernels on a CPU: TRITON_INTERPRET=1 must be set before triton is imported
(the kernels are decorated at import), so it is set here, before any test module of this folder
imports them. triton is a dev dependency: these tests never skip for want of it. The tiny
checkpoints are the folder above's (tests/services/thinker/conftest.py). `launches`: a record of
the launches of the kernels a test watches."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


class Launches:
    """Records each launch of the kernels it watches: (kernel name, grid, its ROT constant), and
    apart (`arguments`) its positional arguments."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log: list[tuple[str, tuple, int | None]] = []
        self.calls: list[tuple[str, tuple]] = []
        self.monkeypatch = monkeypatch

    def watch(self, module, name: str) -> None:
        """Replace module.name (a launched kernel, looked up at each launch) by a recording one."""
        kernel, log, calls = getattr(module, name), self.log, self.calls

        class Recorded:
            def __getitem__(self, grid):
                def launch(*args, **constants):
                    log.append((name, tuple(grid), constants.get("ROT")))
                    calls.append((name, args))
                    return kernel[grid](*args, **constants)

                return launch

        self.monkeypatch.setattr(module, name, Recorded())

    def names(self) -> list[str]:
        return [name for name, *_ in self.log]

    def of(self, name: str) -> list[tuple[tuple, int | None]]:
        """(grid, ROT) of each launch of `name`, in order."""
        return [(grid, rot) for n, grid, rot in self.log if n == name]

    def arguments(self, name: str) -> list[tuple]:
        """The positional arguments of each launch of `name`, in order."""
        return [args for n, args in self.calls if n == name]


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Launches:
    return Launches(monkeypatch)


ALIGN_KERNELS = ("_align_one_program_kernel", "_count_kernel", "_runs_kernel", "_scatter_kernel")


@pytest.fixture
def moe_launches(monkeypatch) -> Launches:
    """Every router and alignment launch (kernels/moe_align.py) in the test, in order (`names()`)."""
    from omnistage.services.thinker.kernels import moe_align, router

    watched = Launches(monkeypatch)
    for name in ALIGN_KERNELS:
        watched.watch(moe_align, name)
    watched.watch(router, "_route_kernel")
    return watched
