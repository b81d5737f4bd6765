"""`ConfigError` and the value checks every section's `validate` shares."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class ConfigError(ValueError):
    """A deploy file that cannot be used; the message names the key path."""


def positive(path: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{path}: expected {'>= 0' if allow_zero else '> 0'}, got {value!r}")


def positive_fields(section: object, path: str, keys: Iterable[str], allow_zero: bool = False) -> None:
    """`positive` on each of `keys` of `section`, named `<path>.<key>`."""
    for key in keys:
        positive(f"{path}.{key}", getattr(section, key), allow_zero=allow_zero)


def batch_sizes(path: str, sizes: Sequence[int]) -> None:
    """A start-up stress's batch sizes: at least one, each >= 1."""
    if not sizes or any(b < 1 for b in sizes):
        raise ConfigError(f"{path}: expected batch sizes >= 1, got {list(sizes)}")
