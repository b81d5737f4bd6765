"""The layout of the code: the formatter owns it (the tree is `ruff format`-clean, no code opts out),
and functions, classes and files stay within their size limits where those hold (`SIZE_LIMITED`)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_tree_is_formatted_by_the_formatter():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "."],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"run `ruff format .`:\n{proc.stdout[-3000:]}{proc.stderr[-2000:]}"


def test_no_code_opts_out_of_the_formatter():
    marked = [
        str(p.relative_to(ROOT))
        for d in ("common", "services", "tests", "bench", "load_tests", "protos")
        for p in (ROOT / d).rglob("*.py")
        if "fmt: " + "skip" in p.read_text() or "fmt: " + "off" in p.read_text()
    ]
    assert marked == []


# Where the size limits hold (developers' guide: no function over 60 lines, no class over 300, no file
# over 600). A folder joins this list once it is brought under them (the gateway and the talker next).
SIZE_LIMITED = ("common", "services")
MAX_FUNCTION_LINES = 60
MAX_CLASS_LINES = 300
MAX_FILE_LINES = 600


def _sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for d in folders for p in (ROOT / d).rglob("*.py") if "_pb2" not in p.name)


def _is_kernel(node: ast.AST) -> bool:
    """A Triton kernel (`@triton.jit`): it takes no structs, so every operand is a parameter of its
    own and the formatter gives each a line; its size is its body's (docstring included)."""
    decorators = getattr(node, "decorator_list", [])
    return isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in decorators)


def oversized(folders: tuple[str, ...] = SIZE_LIMITED) -> list[str]:
    """Every function, class and file past its limit under `folders`: `path:line name (N lines)`."""
    found = []
    for path in _sources(folders):
        text = path.read_text()
        where = path.relative_to(ROOT)
        if (lines := len(text.splitlines())) > MAX_FILE_LINES:
            found.append(f"{where}: file ({lines} lines > {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
                start = node.body[0].lineno if _is_kernel(node) else node.lineno
                size = node.end_lineno - start + 1
                if size > limit:
                    found.append(f"{where}:{node.lineno} {node.name} ({size} lines > {limit})")
    return found


def test_no_function_class_or_file_is_past_its_size_limit():
    assert oversized() == []


def test_the_size_check_finds_what_is_past_a_limit(tmp_path, monkeypatch):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "big.py").write_text(f"def long_one():\n{body}\n\n\ndef short_one():\n    return 1\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert oversized((".",)) == [f"big.py:1 long_one ({MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES})"]


def test_a_kernels_parameters_do_not_count_its_body_does(tmp_path, monkeypatch):
    params = "".join(f"    p{i},\n" for i in range(MAX_FUNCTION_LINES))
    short = "    return p0\n"
    long = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES + 1))
    source = f"@triton.jit\ndef kernel(\n{params}):\n{short}\n\n@triton.jit\ndef long_kernel(p0):\n{long}"
    text = source + f"\n\ndef host(\n{params}):\n{short}"
    (tmp_path / "k.py").write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    line = {name: text.splitlines().index(f"def {name}") + 1 for name in ("long_kernel(p0):", "host(")}
    assert oversized((".",)) == [  # `kernel`: 60 parameters and one statement, within the limit
        f"k.py:{line['long_kernel(p0):']} long_kernel ({MAX_FUNCTION_LINES + 1} lines > {MAX_FUNCTION_LINES})",
        f"k.py:{line['host(']} host ({MAX_FUNCTION_LINES + 3} lines > {MAX_FUNCTION_LINES})",
    ]


# Every stage folder has the same files for the same jobs (docs/architecture.md, "One shape for every
# stage").
SHAPED_STAGES = ("encoder", "imagegen", "talker", "thinker")
STAGE_FILES = {
    "__main__.py": "the stage's StageStartup for the common boot, and main()",
    "server.py": "the servicer: protos in and out",
    "request_flow.py": "the request flow: admission slot, request state, the device loop",
    "runner.py": "the runner: the model calls, one device step",
    "startup.py": "the start-up work: stress, warm-up",
    "models": "the models",
}
# What a servicer may import of its own stage: its flow, and the request type it builds from the proto.
SERVICER_IMPORTS = {"request_flow", "items"}


@pytest.mark.parametrize("stage", SHAPED_STAGES)
def test_every_stage_folder_has_the_same_files_for_the_same_jobs(stage):
    folder = ROOT / "services" / stage
    assert [name for name in STAGE_FILES if not (folder / name).exists()] == []


@pytest.mark.parametrize("stage", SHAPED_STAGES)
def test_a_servicer_never_reaches_past_its_flow(stage):
    tree = ast.parse((ROOT / "services" / stage / "server.py").read_text())
    prefix = f"omnistage.services.{stage}."
    own = {
        node.module.removeprefix(prefix).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(prefix)
    }
    assert own <= SERVICER_IMPORTS, own - SERVICER_IMPORTS
