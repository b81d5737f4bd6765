"""Programmatic dependent launch: a kernel launched with it waits for every prior kernel before it
touches memory, every launch of such a kernel goes through `pdl.launch`, and the switch is refused
when it is neither on nor off. (On the GPU the decode tests compare the PDL graphs with eager and the
reference: tests/services/thinker/engine/test_decode_fusions_gpu.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from omnistage.services.thinker.kernels import pdl

KERNELS_DIR = Path(pdl.__file__).parent


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    def jitted(fn: ast.FunctionDef) -> bool:
        return any("triton.jit" in ast.unparse(d) for d in fn.decorator_list)

    return {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and jitted(n)}


def _pdl_kernels() -> dict[Path, dict[str, ast.FunctionDef]]:
    found = {}
    for path in sorted(KERNELS_DIR.glob("*.py")):
        tree = ast.parse(path.read_text())
        kernels = {
            name: fn
            for name, fn in _jit_functions(tree).items()
            if any(a.arg == "USE_PDL" for a in fn.args.args) and name != "wait_for_prior_kernels"
        }
        if kernels:
            found[path] = kernels
    return found


def test_the_decode_steps_kernels_are_launched_with_pdl():
    names = {name for kernels in _pdl_kernels().values() for name in kernels}
    decode_step = {"_rms_norm_kernel", "_qk_norm_rope_kernel", "_decode_kernel", "_route_kernel"}
    decode_step |= {"_align_one_program_kernel", "_expert_gemm_kernel", "_combine_kernel"}
    assert decode_step <= names


def test_a_pdl_kernel_waits_for_the_prior_kernels_before_anything_else():
    for path, kernels in _pdl_kernels().items():
        for name, fn in kernels.items():
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            first = ast.unparse(body[0])
            assert first == "wait_for_prior_kernels(USE_PDL)", f"{path.name}:{name} starts with {first!r}"


def test_every_launch_of_a_pdl_kernel_passes_pdl_launch():
    for path, kernels in _pdl_kernels().items():
        tree = ast.parse(path.read_text())
        launches = [
            call
            for call in ast.walk(tree)
            if isinstance(call, ast.Call)
            and isinstance(call.func, ast.Subscript)
            and ast.unparse(call.func.value) in kernels
        ]
        assert {ast.unparse(c.func.value) for c in launches} == set(kernels), path.name
        for call in launches:
            spread = [k for k in call.keywords if k.arg is None]
            assert any(ast.unparse(k.value).startswith("pdl.launch(") for k in spread), (
                f"{path.name}: {ast.unparse(call.func.value)} launched without pdl.launch"
            )


def test_off_a_gpu_nothing_is_launched_with_pdl():
    assert pdl.launch(torch.device("cpu")) == {"USE_PDL": False}


def test_the_switch_takes_on_or_off_only(monkeypatch):
    monkeypatch.setenv(pdl.PDL_ENV, "off")
    assert not pdl.requested()
    monkeypatch.setenv(pdl.PDL_ENV, "ON")
    assert pdl.requested()
    monkeypatch.setenv(pdl.PDL_ENV, "1")
    with pytest.raises(ValueError, match="OMNISTAGE_THINKER_PDL='1': expected on or off"):
        pdl.requested()
