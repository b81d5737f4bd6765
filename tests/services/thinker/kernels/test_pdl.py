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


WAIT = "wait_for_prior_kernels(USE_PDL)"


def before_wait_problems(fn: ast.FunctionDef, static: tuple[str, ...]) -> list[str]:
    """What `fn` does before its wait that it may not: anything at all unless `static` names
    operands, and then any pointer parameter but those, or any store or atomic."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    at = next((i for i, s in enumerate(body) if ast.unparse(s) == WAIT), None)
    if at is None:
        return [f"{fn.name}: no {WAIT}"]
    if not static:
        return [] if at == 0 else [f"{fn.name} starts with {ast.unparse(body[0])!r}"]
    pointers = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}
    problems = []
    for node in (n for s in body[:at] for n in ast.walk(s)):
        if isinstance(node, ast.Name) and node.id in pointers and node.id not in static:
            problems.append(f"{fn.name} reads {node.id} before its wait")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "store" or node.func.attr.startswith("atomic"):
                problems.append(f"{fn.name} writes before its wait: {ast.unparse(node)}")
    return problems


def test_a_pdl_kernel_waits_for_the_prior_kernels_before_anything_but_its_weights():
    for path, kernels in _pdl_kernels().items():
        for name, fn in kernels.items():
            early = pdl.STATIC_OPERANDS.get(name, ()) + pdl.SETTLED_OPERANDS.get(name, ())
            assert before_wait_problems(fn, early) == [], path.name
    kernels = {name for found in _pdl_kernels().values() for name in found}
    assert set(pdl.STATIC_OPERANDS) | set(pdl.SETTLED_OPERANDS) <= kernels


def test_the_rule_catches_a_read_or_a_write_before_the_wait():
    source = """
@triton.jit
def k(x_ptr, w_ptr, out_ptr, USE_PDL: tl.constexpr):
    w = tl.load(w_ptr)
    STEP
    wait_for_prior_kernels(USE_PDL)
    tl.store(out_ptr, tl.load(x_ptr) + w)
"""

    def problems(step: str, static: tuple[str, ...] = ("w_ptr",)) -> list[str]:
        fn = ast.parse(source.replace("STEP", step)).body[0]
        return before_wait_problems(fn, static)

    assert problems("pass") == []
    assert problems("x = tl.load(x_ptr)") == ["k reads x_ptr before its wait"]
    assert problems("tl.store(w_ptr, w)") == ["k writes before its wait: tl.store(w_ptr, w)"]
    assert problems("tl.atomic_add(w_ptr, 1)") == ["k writes before its wait: tl.atomic_add(w_ptr, 1)"]
    assert problems("pass", static=()) == ["k starts with 'w = tl.load(w_ptr)'"]


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
