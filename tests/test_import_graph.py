"""The import graph of services/ and common/ has no two-file cycle and no two folders that import
each other. Every import counts: module level, inside functions, and under `if TYPE_CHECKING:`
(a type-only cycle is still two modules that each need the other to be read). A folder and the
folders inside it are one package's layers, not a pair (`common/runtime/` may use `common/config.py`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PREFIX = "omnistage"


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([PREFIX, *parts])


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for d in ("services", "common") for p in sorted((root / d).rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every dotted name `path` imports anywhere in its body, relative imports resolved; a
    `from pkg import x` names `pkg.x` (a submodule, when one exists) as well as `pkg`."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)
    return names


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of services/ and common/ it imports (the longest known prefix of each name)."""
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        targets = set()
        for imported in imported_names(path, name):
            while imported and imported not in mods:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def two_file_cycles(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    return sorted((a, b) for a, targets in graph.items() for b in targets if a < b and a in graph.get(b, ()))


def folder_pairs(
    graph: dict[str, set[str]], mods: dict[str, Path], root: Path = ROOT
) -> dict[tuple[str, str], list[str]]:
    """Pairs of folders (neither inside the other) that import each other, with the imports that do it."""

    def folder(m: str) -> Path:
        return mods[m].parent.relative_to(root)

    edges: dict[tuple[Path, Path], list[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder(a), folder(b)
            if fa != fb and fa not in fb.parents and fb not in fa.parents:
                edges.setdefault((fa, fb), []).append(f"{a} -> {b}")
    return {
        (str(fa), str(fb)): sorted(lines + edges[(fb, fa)])
        for (fa, fb), lines in edges.items()
        if str(fa) < str(fb) and (fb, fa) in edges
    }


def test_no_two_modules_import_each_other():
    assert two_file_cycles(import_graph(modules())) == []


def test_no_two_folders_import_each_other():
    mods = modules()
    assert folder_pairs(import_graph(mods), mods) == {}


def _tree(tmp: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp / rel).write_text(text)
    return tmp


def test_the_checks_see_function_level_relative_and_type_only_imports(tmp_path):
    """The checks themselves: each kind of import closes a cycle they report."""
    root = _tree(
        tmp_path,
        {
            "common/a/__init__.py": "",
            "common/a/x.py": "def f():\n    from omnistage.common.b import y\n",
            "common/a/z.py": "from . import x\n",
            "common/b/__init__.py": "",
            "common/b/y.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from omnistage.common.a.x import f\n"
            ),
            "common/top.py": "from omnistage.common.a import z\n",
            "services/__init__.py": "",
        },
    )
    mods = modules(root)
    graph = import_graph(mods)
    assert graph["omnistage.common.a.z"] == {"omnistage.common.a", "omnistage.common.a.x"}
    assert graph["omnistage.common.top"] == {"omnistage.common.a", "omnistage.common.a.z"}
    assert two_file_cycles(graph) == [("omnistage.common.a.x", "omnistage.common.b.y")]
    assert folder_pairs(graph, mods, root) == {
        ("common/a", "common/b"): [
            "omnistage.common.a.x -> omnistage.common.b",
            "omnistage.common.a.x -> omnistage.common.b.y",
            "omnistage.common.b.y -> omnistage.common.a.x",
        ]
    }
