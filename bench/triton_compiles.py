"""Which Triton kernels a run compiled, phase by phase: new entries of the on-disk kernel cache.

A kernel variant compiled after the warm-up is a first-use cost a real request pays (hundreds of ms
each on a fresh machine). `CompileWatch.mark(phase)` prints what the cache gained since the last mark:
each new kernel's name with its launch meta (warps, stages) and the constexprs Triton recorded, so the
variant can be traced to a tile table row or a shape the warm-up misses. Empty cache dir per run: the
bench scripts point TRITON_CACHE_DIR at a fresh directory when they want every compile seen.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def _describe(meta_file: Path) -> str:
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError):
        return meta_file.stem
    keys = ("num_warps", "num_stages")
    launch = " ".join(f"{k.removeprefix('num_')}={meta[k]}" for k in keys if k in meta)
    consts = meta.get("constants") or {}
    shown = ", ".join(f"{k}={v}" for k, v in list(consts.items())[:10]) if isinstance(consts, dict) else ""
    return f"{meta.get('name', meta_file.stem)} [{launch}] {shown}".rstrip()


class CompileWatch:
    """Kernel cache entries seen so far; `mark` reports (and returns) the ones added since."""

    def __init__(self, cache_dir: str | None = None) -> None:
        root = cache_dir or os.environ.get("TRITON_CACHE_DIR") or str(Path.home() / ".triton" / "cache")
        self.root = Path(root)
        self.seen = self._entries()

    def _entries(self) -> set[Path]:
        if not self.root.is_dir():
            return set()
        return {p for p in self.root.glob("*/*.json") if not p.name.startswith("__grp__")}

    def mark(self, phase: str) -> list[str]:
        now = self._entries()
        new = sorted(now - self.seen, key=lambda p: p.stat().st_mtime)
        self.seen = now
        described = [_describe(p) for p in new]
        print(f"[compiles] {phase}: {len(described)} new Triton kernel(s)", flush=True)
        for line in described:
            print(f"  {line}", flush=True)
        return described
