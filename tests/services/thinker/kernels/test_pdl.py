"""Programmatic dependent launch: a kernel launched with it waits for every prior kernel before it
touches memory (but for loads of its declared static operands, pdl.STATIC_OPERANDS), every launch of
such a kernel goes through `pdl.launch`, and the switch is refused when it is neither on nor off. (On the GPU the decode tests compare the PDL graphs with eager and the
reference: tests/services/thinker/engine/test_decode_fusions_gpu.py.)"""

from __future__ import annotations

import ast
import copy
import textwrap
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
    decode_step |= {"_rope_gather_kernel", "_embed_gather_kernel", "_dense_gate_up_kernel"}
    assert decode_step <= names


WAIT = "wait_for_prior_kernels(USE_PDL)"


def pre_wait_violations(fn: ast.FunctionDef, static: tuple[str, ...] = ()) -> list[str]:
    """What kernel `fn` does before its wait that pdl.STATIC_OPERANDS' rule forbids ([]: nothing):
    the wait must be a top-level statement; before it, with no static operands declared, nothing;
    else only assignments (or `if` on constexpr parameters holding them) that name no pointer
    parameter (`*_ptr`) but the declared ones, and those only as the pointer of a `tl.load` (no
    store or atomic, no helper given a pointer)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    waits = [i for i, s in enumerate(body) if ast.unparse(s) == WAIT]
    if not waits:
        return [f"no top-level {WAIT}"]
    before = body[: waits[0]]
    if before and not static:
        return [f"{ast.unparse(before[0]).splitlines()[0]!r} before the wait, no static operands declared"]
    pointers = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}
    constexprs = {
        a.arg for a in fn.args.args if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
    }
    problems: list[str] = []

    def visit(node: ast.AST, loaded: bool) -> None:
        """`loaded`: node is (part of the arithmetic of) the pointer a tl.load reads."""
        if isinstance(node, ast.Name) and node.id in pointers:
            if node.id not in static:
                problems.append(f"{node.id} (not a static operand) before the wait")
            elif not loaded:
                problems.append(f"{node.id} before the wait other than as the pointer of a tl.load")
            return
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name.split(".")[-1] == "store" or name.split(".")[-1].startswith("atomic_"):
                problems.append(f"{name} before the wait")
            if name == "tl.load":
                pointer = node.args[:1] + [k.value for k in node.keywords if k.arg == "pointer"]
                rest = node.args[1:] + [k.value for k in node.keywords if k.arg != "pointer"]
                for child in pointer:
                    visit(child, True)
                for child in rest:
                    visit(child, False)
                return
            for child in ast.iter_child_nodes(node):  # a helper's arguments: never a pointer
                visit(child, False)
            return
        for child in ast.iter_child_nodes(node):
            visit(child, loaded)

    def statement(stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assign):
            visit(stmt, False)
        elif (
            isinstance(stmt, ast.If)
            and {n.id for n in ast.walk(stmt.test) if isinstance(n, ast.Name)} <= constexprs
        ):
            for inner in stmt.body + stmt.orelse:
                statement(inner)
        else:
            problems.append(f"{ast.unparse(stmt).splitlines()[0]!r} before the wait: not an assignment")

    for stmt in before:
        statement(stmt)
    return problems


class _Taking(ast.NodeTransformer):
    """A kernel's syntax tree with every `if FLAG:` / `if not FLAG:` resolved to the branch it
    takes when the constexpr FLAG is `value` (the variant a launch compiles)."""

    def __init__(self, flag: str, value: bool) -> None:
        self.flag, self.value = flag, value

    def visit_If(self, node: ast.If) -> ast.AST | list[ast.stmt]:
        self.generic_visit(node)
        test = node.test
        negated = isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not)
        name = test.operand if negated else test
        if not (isinstance(name, ast.Name) and name.id == self.flag):
            return node
        return node.body if self.value != negated else node.orelse


def variants(name: str, fn: ast.FunctionDef) -> list[tuple[ast.FunctionDef, tuple[str, ...]]]:
    """Kernel `name`'s variants, each with the pointers it may read before its wait: one, or where
    pdl.SETTLED_WHEN names a constexpr of it, its True and False variants (the False one without
    the operands settled only in the True one)."""
    early = pdl.STATIC_OPERANDS.get(name, ()) + pdl.SETTLED_OPERANDS.get(name, ())
    if name not in pdl.SETTLED_WHEN:
        return [(fn, early)]
    flag, only_if = pdl.SETTLED_WHEN[name]
    taken = [_Taking(flag, value).visit(copy.deepcopy(fn)) for value in (True, False)]
    return [(taken[0], early), (taken[1], tuple(p for p in early if p not in only_if))]


def test_a_pdl_kernel_waits_for_the_prior_kernels_before_anything_but_its_static_loads():
    kernels = {name: (path, fn) for path, found in _pdl_kernels().items() for name, fn in found.items()}
    for name, (path, fn) in kernels.items():
        for variant, early in variants(name, fn):
            problems = pre_wait_violations(variant, early)
            assert problems == [], f"{path.name}:{name}: {problems}"
    for name, (flag, only_if) in pdl.SETTLED_WHEN.items():
        fn = kernels[name][1]
        constexprs = {
            a.arg for a in fn.args.args if a.annotation and "constexpr" in ast.unparse(a.annotation)
        }
        assert flag in constexprs, f"{name}: {flag} is no constexpr of it"
        assert only_if and set(only_if) <= set(pdl.SETTLED_OPERANDS[name]), name
    for name, static in [*pdl.STATIC_OPERANDS.items(), *pdl.SETTLED_OPERANDS.items()]:  # none stale
        assert name in kernels, f"{name} is declared, no PDL kernel"
        params = {a.arg for a in kernels[name][1].args.args}
        assert static and set(static) <= params and all(p.endswith("_ptr") for p in static), name
    assert pdl.STATIC_OPERANDS["_route_kernel"] == ("w_ptr", "bias_ptr", "norm_w_ptr")
    assert pdl.STATIC_OPERANDS["_dense_gate_up_kernel"] == ("w_ptr", "norm_w_ptr")


def _kernel(source: str) -> ast.FunctionDef:
    return ast.parse(textwrap.dedent(source)).body[0]


SYNTHETIC = """
@triton.jit
def _k(x_ptr, w_ptr, out_ptr, n, GEMV: tl.constexpr, USE_PDL: tl.constexpr):
    \"\"\"A docstring is not a statement.\"\"\"
    offs = tl.program_id(0) * 16 + tl.arange(0, 16)
    {before}
    wait_for_prior_kernels(USE_PDL)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs) * w)
"""


@pytest.mark.parametrize(
    "before,static,why",
    [
        ("w = tl.load(w_ptr + offs, mask=offs < n)", ("w_ptr",), None),
        ("w = tl.load(pointer=w_ptr + _offsets(offs, n))", ("w_ptr",), None),
        ("if GEMV:\n        w = tl.load(w_ptr + offs)", ("w_ptr",), None),
        ("w = tl.load(x_ptr + offs)", ("w_ptr",), "x_ptr (not a static operand)"),
        ("w = tl.load(w_ptr + offs) + tl.load(x_ptr)", ("w_ptr",), "x_ptr (not a static operand)"),
        ("w = tl.load(w_ptr + offs)", (), "no static operands declared"),
        ("w = _load(w_ptr, offs)", ("w_ptr",), "other than as the pointer of a tl.load"),
        ("w = tl.load(_at(w_ptr, offs))", ("w_ptr",), "other than as the pointer of a tl.load"),
        ("p = w_ptr + offs", ("w_ptr",), "other than as the pointer of a tl.load"),
        ("w = tl.atomic_add(w_ptr + offs, 1)", ("w_ptr",), "tl.atomic_add before the wait"),
        ("tl.store(w_ptr + offs, 0.0)", ("w_ptr",), "not an assignment"),
        ("if n > 0:\n        w = tl.load(w_ptr + offs)", ("w_ptr",), "not an assignment"),
        ("for i in range(n):\n        w = tl.load(w_ptr + offs)", ("w_ptr",), "not an assignment"),
    ],
)
def test_the_static_operand_rule_refuses_anything_but_static_loads_before_the_wait(before, static, why):
    problems = pre_wait_violations(_kernel(SYNTHETIC.format(before=before)), static)
    if why is None:
        assert problems == []
    else:
        assert problems and any(why in p for p in problems), problems


SETTLED_IF = """
@triton.jit
def _k(x_ptr, w_ptr, ids_ptr, out_ptr, SETTLED: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 16)
    w = tl.load(w_ptr + offs)
    if SETTLED:
        ids = tl.load(ids_ptr + offs)
    {before}
    wait_for_prior_kernels(USE_PDL)
    if not SETTLED:
        ids = tl.load(ids_ptr + offs)
    tl.store(out_ptr + offs, tl.load(x_ptr + ids) * w)
"""


@pytest.mark.parametrize(
    "before,refused",
    [
        ("", ()),  # the ids before the wait only where they are settled
        ("if not SETTLED:\n        early = tl.load(ids_ptr)", (False,)),
        ("else_ids = tl.load(ids_ptr + offs)", (False,)),
        (
            "if SETTLED:\n        more = tl.load(ids_ptr)\n    else:\n        more = tl.load(ids_ptr)",
            (False,),
        ),
    ],
)
def test_an_operand_settled_only_in_one_variant_is_read_after_the_wait_in_the_other(
    before, refused, monkeypatch
):
    monkeypatch.setitem(pdl.STATIC_OPERANDS, "_k", ("w_ptr",))
    monkeypatch.setitem(pdl.SETTLED_OPERANDS, "_k", ("ids_ptr",))
    monkeypatch.setitem(pdl.SETTLED_WHEN, "_k", ("SETTLED", ("ids_ptr",)))
    fn = _kernel(SETTLED_IF.format(before=before))
    for value, (variant, early) in zip((True, False), variants("_k", fn), strict=True):
        problems = pre_wait_violations(variant, early)
        if value in refused:
            assert any("ids_ptr (not a static operand)" in p for p in problems), (value, problems)
        else:
            assert problems == [], (value, problems)
    # Without the declaration both variants are taken as one: every pre-wait read allowed.
    monkeypatch.delitem(pdl.SETTLED_WHEN, "_k")
    assert pre_wait_violations(fn, ("w_ptr", "ids_ptr")) == []


def test_a_kernel_whose_wait_is_not_a_top_level_statement_is_refused():
    source = """
    @triton.jit
    def _k(x_ptr, USE_PDL: tl.constexpr):
        if USE_PDL:
            wait_for_prior_kernels(USE_PDL)
        tl.load(x_ptr)
    """
    assert pre_wait_violations(_kernel(source), ("x_ptr",)) == [f"no top-level {WAIT}"]
    waits_first = SYNTHETIC.replace("    offs = tl.program_id(0) * 16 + tl.arange(0, 16)\n", "")
    assert pre_wait_violations(_kernel(waits_first.format(before="")), ()) == []


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
