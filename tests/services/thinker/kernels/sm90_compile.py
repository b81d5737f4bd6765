"""Compile the thinker's Triton kernels for sm_90 on a machine without a GPU (triton's own ptxas):
the interpreter runs code the real compiler may reject (a reassigned constexpr, say), so CI
compiles each kernel with the argument types and constants the fast path launches it with."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def compile_sm90(fn, types: dict[str, str], constants: dict[str, object]) -> object:
    """`types`: argument name → triton type ("*bf16", "i32", "fp32"); `constants`: constexpr values."""
    signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
    missing = [n for n, t in signature.items() if t == "constexpr" and n not in constants]
    if missing:
        raise ValueError(f"{fn.__name__}: no type or constant for {missing}")
    return triton.compile(ASTSource(fn, signature, constants), target=SM90)
