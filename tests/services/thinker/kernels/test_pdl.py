"""Programmatic dependent launch: a kernel launched with it waits for every prior kernel before it
touches memory (but for loads of its declared static operands, pdl.STATIC_OPERANDS, and the bounded
poll of a flag with the loads it announces, pdl.FLAGGED_OPERANDS), every launch of
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


def pre_wait_violations(
    fn: ast.FunctionDef, static: tuple[str, ...] = (), flagged: tuple[str, tuple[str, ...]] | None = None
) -> list[str]:
    """What kernel `fn` does before its wait that pdl.STATIC_OPERANDS' rule forbids ([]: nothing):
    the wait must be a top-level statement; before it, with no static operands declared, nothing;
    else only assignments (or `if` on constexpr parameters holding them) that name no pointer
    parameter (`*_ptr`) but the declared ones, and those only as the pointer of a `tl.load` (no
    store or atomic, no helper given a pointer). `flagged` (pdl.FLAGGED_OPERANDS' entry: the flag
    parameter, the operands it announces) allows too an assignment of `poll_flag(<the flag>, ...)`
    and, after it, loads from those operands masked by the poll's result."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    waits = [i for i, s in enumerate(body) if ast.unparse(s) == WAIT]
    if not waits:
        return [f"no top-level {WAIT}"]
    before = body[: waits[0]]
    if before and not (static or flagged):
        return [f"{ast.unparse(before[0]).splitlines()[0]!r} before the wait, no static operands declared"]
    checker = _PreWait(fn, static, flagged)
    for stmt in before:
        checker.statement(stmt)
    return checker.problems


def _names(node: ast.AST | None) -> set[str]:
    return set() if node is None else {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def _called(node: ast.Call) -> str:
    return ast.unparse(node.func).split(".")[-1]


class _PreWait:
    """`pre_wait_violations`' walk of the statements before the wait. `guards`: the poll's result
    (the first name it is assigned to) and every name assigned from an expression naming a guard."""

    def __init__(self, fn: ast.FunctionDef, static: tuple[str, ...], flagged) -> None:
        self.pointers = {a.arg for a in fn.args.args if a.arg.endswith("_ptr")}
        self.constexprs = {
            a.arg
            for a in fn.args.args
            if a.annotation is not None and "constexpr" in ast.unparse(a.annotation)
        }
        self.static, (self.flag, self.announced) = static, flagged or (None, ())
        self.guards: set[str] = set()
        self.problems: list[str] = []

    def statement(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, ast.Assign):
            self.assign(stmt)
        elif isinstance(stmt, ast.If) and _names(stmt.test) <= self.constexprs:
            for inner in stmt.body + stmt.orelse:
                self.statement(inner)
        else:
            self.problems.append(f"{ast.unparse(stmt).splitlines()[0]!r} before the wait: not an assignment")

    def assign(self, stmt: ast.Assign) -> None:
        targets = [n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        value = stmt.value
        if not (isinstance(value, ast.Call) and _called(value) == "poll_flag"):
            self.visit(stmt, False, False)
            if _names(value) & self.guards:
                self.guards |= set(targets)
            return
        flag = value.args[0] if value.args else None
        if self.flag is None:
            self.problems.append("poll_flag in a kernel pdl.FLAGGED_OPERANDS does not name")
        elif not (isinstance(flag, ast.Name) and flag.id == self.flag):
            self.problems.append(f"poll_flag not given the flag {self.flag}")
        for child in value.args[1:] + [k.value for k in value.keywords]:
            self.visit(child, False, False)
        self.guards.add(targets[0])

    def visit(self, node: ast.AST, loaded: bool, guarded: bool) -> None:
        """`loaded`: node is (part of the arithmetic of) the pointer a tl.load reads; `guarded`: that
        load's mask names a guard."""
        if isinstance(node, ast.Name) and node.id in self.pointers:
            self.pointer(node.id, loaded, guarded)
            return
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if _called(node) in ("store", "poll_flag") or _called(node).startswith("atomic_"):
                self.problems.append(f"{name} before the wait")
            if name == "tl.load":
                pointer = node.args[:1] + [k.value for k in node.keywords if k.arg == "pointer"]
                mask = node.args[1:2] + [k.value for k in node.keywords if k.arg == "mask"]
                rest = node.args[1:] + [k.value for k in node.keywords if k.arg != "pointer"]
                masked = any(_names(m) & self.guards for m in mask)
                for child in pointer:
                    self.visit(child, True, masked)
                for child in rest:
                    self.visit(child, False, False)
                return
            for child in ast.iter_child_nodes(node):  # a helper's arguments: never a pointer
                self.visit(child, False, False)
            return
        for child in ast.iter_child_nodes(node):
            self.visit(child, loaded, guarded)

    def pointer(self, name: str, loaded: bool, guarded: bool) -> None:
        if name in self.announced and name not in self.static:
            if not (loaded and guarded):
                self.problems.append(
                    f"{name} (a flagged operand) before the wait other than as the pointer of a "
                    "tl.load masked by the poll's result"
                )
        elif name not in self.static:
            self.problems.append(f"{name} (not a static operand) before the wait")
        elif not loaded:
            self.problems.append(f"{name} before the wait other than as the pointer of a tl.load")


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
            problems = pre_wait_violations(variant, early, pdl.FLAGGED_OPERANDS.get(name))
            assert problems == [], f"{path.name}:{name}: {problems}"
    for name, (flag, announced) in pdl.FLAGGED_OPERANDS.items():  # none stale: each polls its flag
        params = {a.arg for a in kernels[name][1].args.args}
        assert {flag, *announced} <= params and announced, name
        assert f"poll_flag({flag}," in ast.unparse(kernels[name][1]), name
        assert all(pre_wait_violations(*variant) for variant in variants(name, kernels[name][1])), name
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


FLAGGED = """
@triton.jit
def _k(x_ptr, w_ptr, ids_ptr, flag_ptr, out_ptr, FLAGGED: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 16)
    w = tl.load(w_ptr + offs)
    {before}
    wait_for_prior_kernels(USE_PDL)
    tl.store(out_ptr + offs, tl.load(x_ptr + tl.load(ids_ptr + offs)) * w)
"""
POLL = "seen, last = poll_flag(flag_ptr, 8)"


@pytest.mark.parametrize(
    "before,why",
    [
        (f"{POLL}\n    early = tl.load(ids_ptr + offs, mask=offs < tl.where(seen, 16, 0))", None),
        (
            f"if FLAGGED:\n        {POLL}\n        some = tl.where(seen, 16, 0)\n"
            "        early = tl.load(ids_ptr + offs, offs < some, other=-1)",
            None,
        ),
        (f"{POLL}\n    rows = tl.load(w_ptr + tl.load(ids_ptr + offs, mask=seen & (offs < 16)))", None),
        ("early = tl.load(ids_ptr + offs)", "ids_ptr (a flagged operand)"),
        (f"early = tl.load(ids_ptr + offs)\n    {POLL}", "ids_ptr (a flagged operand)"),  # before the poll
        (f"{POLL}\n    early = tl.load(ids_ptr + offs, mask=offs < 16)", "ids_ptr (a flagged operand)"),
        (f"{POLL}\n    early = tl.load(w_ptr + offs, mask=ids_ptr + offs == seen)", "ids_ptr (a flagged"),
        (f"{POLL}\n    early = _at(ids_ptr, seen)", "ids_ptr (a flagged operand)"),
        (f"{POLL}\n    early = tl.load(x_ptr + offs, mask=seen)", "x_ptr (not a static operand)"),
        ("seen, last = poll_flag(ids_ptr, 8)", "poll_flag not given the flag flag_ptr"),
        ("seen = poll_flag(flag_ptr, 8) & True", "poll_flag before the wait"),
        ("poll_flag(flag_ptr, 8)", "not an assignment"),
        ("word = tl.load(flag_ptr)", "flag_ptr (not a static operand)"),
        (f"{POLL}\n    t = tl.atomic_add(flag_ptr + 1, 2)", "tl.atomic_add before the wait"),
        (f"{POLL}\n    t = tl.atomic_xchg(w_ptr + offs, 0.0)", "tl.atomic_xchg before the wait"),
        (f"{POLL}\n    if seen:\n        tl.store(flag_ptr, 0)", "not an assignment"),
        (f"{POLL}\n    t = tl.store(ids_ptr + offs, 0, mask=seen)", "tl.store before the wait"),
    ],
)
def test_the_flagged_operand_rule_takes_only_loads_masked_by_the_polls_result(before, why):
    fn = _kernel(FLAGGED.format(before=before))
    problems = pre_wait_violations(fn, ("w_ptr",), ("flag_ptr", ("ids_ptr",)))
    if why is None:
        assert problems == []
    else:
        assert problems and any(why in p for p in problems), problems


def test_a_poll_in_a_kernel_without_a_flag_is_refused():
    fn = _kernel(FLAGGED.format(before=POLL))
    assert any("pdl.FLAGGED_OPERANDS does not name" in p for p in pre_wait_violations(fn, ("w_ptr",)))
    masked = f"{POLL}\n    early = tl.load(ids_ptr + offs, mask=seen)"
    assert any(
        "ids_ptr (not a static operand)" in p
        for p in pre_wait_violations(_kernel(FLAGGED.format(before=masked)), ("w_ptr",))
    )
