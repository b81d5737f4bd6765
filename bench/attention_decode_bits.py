"""This checkout's paged decode attention (`kernels/paged_attention.py`) against another version of
that file, bit for bit: a change meant to leave every output bit as it was (the split merge, say)
is checked where it runs, on the GPU's compiled code (or, with TRITON_INTERPRET=1, the CPU's).

    git show main:services/thinker/kernels/paged_attention.py > ref_paged_attention.py
    source bench/device_env.sh && python3 bench/attention_decode_bits.py --reference ref_paged_attention.py

(the reference file untracked in the checkout: it travels to the device with the working tree.)
`--preload 1,2,4`: this checkout at each of those tiles read before the PDL wait
(`paged_attention.DecodeTiles(preload_tiles=...)`, 4 warps), each against the reference.
Both versions run on the same inputs: sequences of several context lengths in one launch (with a
padding row: context 0, slot -1) and each length alone (one sequence: the split merge at its
widest), at several split counts, with the cache holding the new K/V, with the launch writing
it (`new_kv`), and with QK-norm + rope folded in too (`qk_rope`). Prints a row per case and a
SUMMARY; exit status 1 when any output or cache differs in any bit.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from types import ModuleType

import torch
from omnistage.services.thinker.kernels import paged_attention
from omnistage.services.thinker.models.layers.rotary import RotaryEmbedding

PAGE = 16
# (query heads, KV heads, head dim) a rank: Ling-mini, Ming-flash at TP=2, a GQA group of 6 (ten
# padding rows of the 16); the CPU's (the interpreter) small.
GPU_SHAPES = {"ling-mini": (16, 4, 128), "ming-flash-tp2": (16, 2, 128), "gqa6": (12, 2, 128)}
CPU_SHAPES = {"gqa4": (8, 2, 32), "gqa6": (12, 2, 32)}
CONTEXTS = (1, 5, 127, 128, 129, 256, 300, 1000, 1024, 2048)
SPLITS = (2, 4, 10, 16)
MODES = ("cached", "write_kv", "qk_rope")


def load_reference(path: str) -> ModuleType:
    """The reference paged_attention.py as a module of its own (its kernels compiled apart)."""
    spec = importlib.util.spec_from_file_location("reference_paged_attention", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered before it runs (its dataclasses look it up)
    spec.loader.exec_module(module)
    return module


class Case:
    """One decode launch's inputs: caches, block tables, q and the new K/V of `contexts` (a context
    0 a padding row: slot -1), QK-norm weights and the rope of the new tokens' positions."""

    def __init__(self, heads: int, kv_heads: int, dim: int, contexts: list[int], dtype, device) -> None:
        pages = [max(1, -(-c // PAGE)) for c in contexts]
        blocks = sum(pages) + 2
        self.caches = torch.randn(2, blocks, PAGE, kv_heads, dim, device=device).to(dtype).unbind(0)
        free = torch.randperm(blocks).tolist()
        self.tables = torch.full((len(contexts), max(pages)), -1, dtype=torch.int64)
        for b, n in enumerate(pages):
            self.tables[b, :n] = torch.tensor([free.pop() for _ in range(n)])
        last = [int(self.tables[b, (c - 1) // PAGE]) * PAGE + (c - 1) % PAGE for b, c in enumerate(contexts)]
        self.slots = torch.tensor(
            [s if c > 0 else -1 for s, c in zip(last, contexts, strict=True)], device=device
        )
        self.tables, self.lens = self.tables.to(device), torch.tensor(contexts, device=device)
        self.q = torch.randn(len(contexts), heads, dim, device=device).to(dtype)
        self.k, self.v = torch.randn(2, len(contexts), kv_heads, dim, device=device).to(dtype).unbind(0)
        positions = torch.tensor([max(c - 1, 0) for c in contexts], device=device)
        cos, sin = RotaryEmbedding(dim, dim // 2, 1e6, "default").cos_sin(positions, dtype)
        weights = torch.randn(2, dim, device=device).to(dtype)
        self.qk_rope = (weights[0], weights[1], 1e-6, cos, sin)
        self.scale = dim**-0.5

    def run(self, module: ModuleType, splits: int, mode: str, *tiles) -> tuple[torch.Tensor, ...]:
        """`module`'s paged_decode (at `tiles`, a DecodeTiles, where given) on copies of the caches →
        (output, K cache, V cache)."""
        k_cache, v_cache = (c.clone() for c in self.caches)
        new_kv = (self.k, self.v, self.slots) if mode != "cached" else None
        qk_rope = self.qk_rope if mode == "qk_rope" else None
        args = (self.q, k_cache, v_cache, self.tables, self.lens, self.scale)
        return module.paged_decode(*args, new_kv, splits, qk_rope, *tiles), k_cache, v_cache


def differing(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...]) -> list[str]:
    """Which of (output, K cache, V cache) differ in any bit (NaNs compared as bits too)."""
    names = ("output", "k_cache", "v_cache")
    return [
        n
        for n, a, b in zip(names, got, want, strict=True)
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reference", required=True, help="the other version's paged_attention.py")
    on_gpu = torch.cuda.is_available()
    shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
    ap.add_argument("--shapes", default=",".join(shapes), help="comma-separated of: " + ", ".join(shapes))
    ap.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    ap.add_argument("--splits", default=",".join(map(str, SPLITS)))
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated of: " + ", ".join(MODES))
    ap.add_argument("--dtypes", default="bf16" if on_gpu else "fp32,bf16")
    ap.add_argument("--preload", help="this checkout at these tiles read before the wait (default: its own)")
    args = ap.parse_args(argv)
    reference = load_reference(args.reference)
    device = "cuda" if on_gpu else "cpu"
    contexts = [int(c) for c in args.contexts.split(",")]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    tiled = (
        [(paged_attention.DecodeTiles(int(p)),) for p in args.preload.split(",")] if args.preload else [()]
    )
    torch.manual_seed(0)
    cases, failed = 0, []
    for name in args.shapes.split(","):
        heads, kv_heads, dim = shapes[name]
        for dtype_name in args.dtypes.split(","):
            launches = [[*contexts, 0]] + [[c] for c in contexts]  # all at once, then each alone
            for lens in launches:
                case = Case(heads, kv_heads, dim, lens, dtypes[dtype_name], device)
                for splits in (int(s) for s in args.splits.split(",")):
                    for mode in args.modes.split(","):
                        want = case.run(reference, splits, mode)
                        for tiles in tiled:
                            diff = differing(case.run(paged_attention, splits, mode, *tiles), want)
                            cases += 1
                            where = f"{name} {dtype_name} contexts={lens} splits={splits} {mode}"
                            where += f" preload={tiles[0].preload_tiles}" if tiles else ""
                            print(
                                f"bits   {where}: {'DIFFERS in ' + ', '.join(diff) if diff else 'equal'}",
                                flush=True,
                            )
                            if diff:
                                failed.append(where)
    print(f"SUMMARY {cases - len(failed)} of {cases} cases bit-equal; differing: {failed}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
