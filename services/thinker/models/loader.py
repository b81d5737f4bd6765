"""load_model: meta-device build, then shard-by-shard safetensors streaming into this rank's slices.

Parameters are materialised once, empty, in the target dtype on the target device; each checkpoint
tensor is read alone (CPU, stored dtype) and the owning layer's `weight_loader` copies only this
rank's slice. Key names and shapes are checked from the shard headers before any data is read, so
a wrong checkpoint fails fast with one error naming every missing, unexpected and mis-shaped key.
Non-thinker keys (`vision.*`, `audio.*`, `linear_proj*`) belong to the encoders: skipped deliberately.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, read_headers, shard_files
from omnistage.common.log import get_logger
from omnistage.services.thinker.models.bailing_moe_v2 import (
    BailingMoeV2ForCausalLM,
    checkpoint_shapes,
    param_for_checkpoint_key,
)
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.layers.parallel import TPGroup
from torch import nn

log = get_logger(__name__)
_MAX_LISTED = 20


def _listing(what: str, keys: list[str]) -> str:
    shown = ", ".join(keys[:_MAX_LISTED])
    more = f" (+{len(keys) - _MAX_LISTED} more)" if len(keys) > _MAX_LISTED else ""
    return f"{what} keys: {shown}{more}"


def _check_keys(ckpt_dir: Path, config: ThinkerConfig, headers: dict) -> None:
    want = checkpoint_shapes(config)
    thinker = {k: v for k, v in headers.items() if param_for_checkpoint_key(k) is not None}
    problems = []
    if missing := sorted(set(want) - set(thinker)):
        problems.append(_listing("missing", missing))
    if unexpected := sorted(set(thinker) - set(want)):
        problems.append(_listing("unexpected", unexpected))
    bad = sorted(
        f"{k} {list(thinker[k].shape)} != {list(want[k])}"
        for k in set(want) & set(thinker)
        if thinker[k].shape != want[k]
    )
    if bad:
        problems.append(_listing("mis-shaped", bad))
    if problems:
        raise CheckpointError(
            f"{ckpt_dir}: thinker checkpoint does not match its config: " + "; ".join(problems)
        )


def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> BailingMoeV2ForCausalLM:
    """Build this rank's thinker from a Ming checkpoint folder; `progress(done_shards, total_shards)`."""
    root = Path(checkpoint_dir)
    config = ThinkerConfig.from_checkpoint(root)
    tp = TPGroup(tp_rank, tp_size)
    shards = shard_files(root)
    headers = read_headers(shards)
    _check_keys(root, config, headers)

    with torch.device("meta"):
        model = BailingMoeV2ForCausalLM(config, tp)
    model = model.to(dtype=dtype).to_empty(device=device)
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    total = len(shards)
    if progress is not None:
        progress(0, total)
    for n, shard in enumerate(shards, start=1):
        keys = [k for k in headers if headers[k].shard == shard and param_for_checkpoint_key(k) is not None]
        for key, tensor in iter_tensors(shard, keys):
            name, shard_id = param_for_checkpoint_key(key)  # type: ignore[misc]
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"{root}: checkpoint key {key} maps to unknown parameter {name}")
            owner = model.get_submodule(name.rpartition(".")[0])
            loader = getattr(owner, "weight_loader", _default_loader)
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise CheckpointError(f"{root}: {key}: {e}") from e
            loaded.add((name, shard_id))
        log.info("loading weights %d/%d shards", n, total)
        if progress is not None:
            progress(n, total)
    _check_all_loaded(root, params, loaded)
    model.requires_grad_(False).eval()
    return model


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _check_all_loaded(root: Path, params: dict[str, nn.Parameter], loaded: set[tuple[str, object]]) -> None:
    """Every parameter received data (guards the name table against silent gaps)."""
    names = {name for name, _ in loaded}
    if untouched := sorted(set(params) - names):
        raise CheckpointError(f"{root}: parameters never loaded: {', '.join(untouched)}")
