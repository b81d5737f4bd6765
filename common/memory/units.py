"""Byte units and their formatting, shared by the accountant, the ledger and stress (no torch import)."""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def fmt_bytes(n: int | float) -> str:
    """Human size for logs and error tables (`4.00 MiB`, `-1.50 GiB`)."""
    n = float(n)
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"
