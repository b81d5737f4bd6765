"""What every model loader does the same way: build on the meta device and materialise once in the target
dtype on the target device, check a checkpoint's keys and shapes against the model before reading any
data (one error naming every missing, unexpected and mis-shaped key), and copy shard by shard into the
parameters (one stored tensor in memory at a time, never a full-precision copy of the model).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

import torch
from omnistage.common.checkpoint.shards import CheckpointError, TensorInfo, iter_tensors
from torch import nn

M = TypeVar("M", bound=nn.Module)
Shape = tuple[int, ...]
# The most keys one line of a key-check error lists (the rest are counted).
MAX_LISTED = 20


def empty_on(build: Callable[[], M], *, dtype: torch.dtype, device: str | torch.device) -> M:
    """`build()` on the meta device, then materialised empty (uninitialised) in `dtype` on `device`:
    no weights are made twice and none in float32 first. Buffers are the caller's to recompute.

    Each tensor is made by `empty_strided` from the meta tensor's size and strides, not by `to_empty`:
    its `empty_like` of a meta tensor goes through torch's Python references, which import
    torch.fx's symbolic shapes and sympy (~1 s of CPU in every process that loads a model)."""
    with torch.device("meta"):
        module = build()
    return module.to(dtype=dtype)._apply(
        lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    )


def _listing(what: str, keys: list[str]) -> str:
    more = f" (+{len(keys) - MAX_LISTED} more)" if len(keys) > MAX_LISTED else ""
    return f"{what} keys: {', '.join(keys[:MAX_LISTED])}{more}"


def check_keys(
    where: str | Path,
    mismatch: str,
    want: Mapping[str, Shape],
    have: Mapping[str, Shape],
    optional: Mapping[str, Shape | None] | None = None,
) -> None:
    """Raise CheckpointError(`<where>: <mismatch>: ...`) naming every key of `want` missing from `have`,
    every key of `have` neither wanted nor `optional`, and every shape that differs. An optional key's
    shape is checked too unless it is None (any shape)."""
    allowed = {**(optional or {}), **want}
    sized = {k: shape for k, shape in allowed.items() if shape is not None}
    problems = []
    if missing := sorted(set(want) - set(have)):
        problems.append(_listing("missing", missing))
    if unexpected := sorted(set(have) - set(allowed)):
        problems.append(_listing("unexpected", unexpected))
    if bad := sorted(
        f"{k} {list(have[k])} != {list(sized[k])}"
        for k in set(sized) & set(have)
        if tuple(have[k]) != tuple(sized[k])
    ):
        problems.append(_listing("mis-shaped", bad))
    if problems:
        raise CheckpointError(f"{where}: {mismatch}: " + "; ".join(problems))


def shapes(
    headers: Mapping[str, TensorInfo], keep: Callable[[str], bool] = lambda key: True
) -> dict[str, Shape]:
    """Key → stored shape of the headers' tensors that `keep` accepts."""
    return {k: h.shape for k, h in headers.items() if keep(k)}


def state_shapes(targets: Mapping[str, torch.Tensor]) -> dict[str, Shape]:
    return {k: tuple(t.shape) for k, t in targets.items()}


def copy_shard(
    shard: Path, headers: Mapping[str, TensorInfo], targets: Mapping[str, torch.Tensor]
) -> set[str]:
    """Copy the tensors of `shard` that have a target into it (cast to its dtype, moved to its device);
    returns the keys copied."""
    keys = [k for k, h in headers.items() if h.shard == shard and k in targets]
    for key, tensor in iter_tensors(shard, keys):
        targets[key].data.copy_(tensor)
    return set(keys)


def check_all_loaded(where: str | Path, what: str, targets: Iterable[str], loaded: set[str]) -> None:
    """Every target was filled: a checkpoint that names a key but never stores it fails here."""
    if untouched := sorted(set(targets) - loaded):
        raise CheckpointError(f"{where}: {what} never loaded: {', '.join(untouched)}")


class LoadProgress:
    """A loader's steps (shards, or modules of dummy weights): `progress(0, total)` at once, then one
    log line and one `progress(done, total)` per `step()` (the launcher's start-up progress and the
    culprit of a stuck load read these)."""

    def __init__(
        self,
        total: int,
        progress: Callable[[int, int], None] | None,
        log: logging.Logger,
        what: str,
        unit: str,
    ) -> None:
        self.total, self.progress, self.log, self.what, self.unit = total, progress, log, what, unit
        self.done = 0
        if progress is not None:
            progress(0, total)

    def step(self, detail: str = "") -> None:
        self.done += 1
        self.log.info(
            "%s %d/%d %s%s", self.what, self.done, self.total, self.unit, f" ({detail})" if detail else ""
        )
        if self.progress is not None:
            self.progress(self.done, self.total)
