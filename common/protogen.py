"""Generate `omnistage/v1/*_pb2*.py{,i}` from the `.proto` files (the single source of truth).

One protoc call with one include root (`protos/`), so generated code imports `omnistage.v1`;
`check()` regenerates into a temp dir and diffs, so stale committed code fails a test.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")
PACKAGE_DIR = Path("omnistage") / "v1"


def proto_root() -> Path:
    """The include root holding omnistage/v1/*.proto (`protos/` in the repo, site-packages when installed)."""
    import omnistage.v1

    return Path(omnistage.v1.__file__).resolve().parents[2]


def _is_generated(path: Path) -> bool:
    return path.name.endswith(GENERATED_SUFFIXES)


def generate(out_root: Path, root: Path | None = None) -> list[Path]:
    """Run protoc on every omnistage/v1/*.proto under `root`, writing into `out_root`; returns the files."""
    from grpc_tools import protoc

    root = root or proto_root()
    protos = sorted((root / PACKAGE_DIR).glob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files in {root / PACKAGE_DIR}")
    out_root.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{root}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *(str(p.relative_to(root)) for p in protos),
    ]
    code = protoc.main(args)
    if code != 0:
        raise RuntimeError(f"protoc failed with exit code {code} (args: {' '.join(args[1:])})")
    return sorted(p for p in (out_root / PACKAGE_DIR).iterdir() if _is_generated(p))


def check(root: Path | None = None) -> list[str]:
    """Differences between the committed generated files and fresh ones; empty when up to date."""
    root = root or proto_root()
    committed = {p.name: p for p in (root / PACKAGE_DIR).iterdir() if _is_generated(p)}
    with tempfile.TemporaryDirectory(prefix="omnistage-protos-") as tmp:
        fresh = {p.name: p.read_bytes() for p in generate(Path(tmp), root)}
    problems = [f"{name}: missing (run `omnistage protos`)" for name in sorted(set(fresh) - set(committed))]
    problems += [f"{name}: generated file without a .proto" for name in sorted(set(committed) - set(fresh))]
    problems += [
        f"{name}: stale (run `omnistage protos`)"
        for name in sorted(set(fresh) & set(committed))
        if committed[name].read_bytes() != fresh[name]
    ]
    return problems


def write(root: Path | None = None) -> list[Path]:
    """Regenerate in place: fresh files replace the committed ones; orphans of deleted protos go."""
    root = root or proto_root()
    target = root / PACKAGE_DIR
    with tempfile.TemporaryDirectory(prefix="omnistage-protos-") as tmp:
        fresh = generate(Path(tmp), root)
        names = {p.name for p in fresh}
        for old in target.iterdir():
            if _is_generated(old) and old.name not in names:
                old.unlink()
        for path in fresh:
            shutil.copyfile(path, target / path.name)
    return [target / p.name for p in fresh]
