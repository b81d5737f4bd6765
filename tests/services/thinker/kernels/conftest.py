"""The thinker's Triton kernels on a CPU: TRITON_INTERPRET=1 must be set before triton is imported
(the kernels are decorated at import), so it is set here, before any test module of this folder
imports them. triton is a dev dependency: these tests never skip for want of it. The tiny
checkpoints are the folder above's (tests/services/thinker/conftest.py)."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")

ALIGN_KERNELS = ("_align_one_program_kernel", "_count_kernel", "_runs_kernel", "_scatter_kernel")


class Counted:
    """A kernel whose launches append its name to `launches` (`+layout`: a router launch with
    LAYOUT, which lays the pairs out for the expert GEMMs), then launch it."""

    def __init__(self, kernel, name: str, launches: list[str]) -> None:
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        def launch(*args, **constants):
            self.launches.append(self.name + ("+layout" if constants.get("LAYOUT") else ""))
            return self.kernel[grid](*args, **constants)

        return launch


@pytest.fixture
def moe_launches(monkeypatch) -> list[str]:
    """The name of every router and alignment launch (kernels/moe_align.py) in the test, in order."""
    from omnistage.services.thinker.kernels import moe_align, router

    launches: list[str] = []
    for name in ALIGN_KERNELS:
        monkeypatch.setattr(moe_align, name, Counted(getattr(moe_align, name), name, launches))
    monkeypatch.setattr(router, "_route_kernel", Counted(router._route_kernel, "_route_kernel", launches))
    return launches
