"""The image-generation query embeddings that hidden-state requests splice in (ming.md §6.1, §6.4)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, read_headers, shard_files
from omnistage.common.log import get_logger

log = get_logger(__name__)
DEFAULT_SCALE = 16  # the release's img_gen_scales [16], for dummy weights without mlp/config.json


def query_scale(checkpoint: str | Path) -> int | None:
    """s of `mlp/config.json` `img_gen_scales[-1]`; None when the checkpoint has no `mlp/` config."""
    path = Path(checkpoint) / "mlp" / "config.json"
    if not path.is_file():
        return None
    try:
        scales = json.loads(path.read_text()).get("img_gen_scales") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: not a JSON object with img_gen_scales: {exc}") from None
    if not scales or not isinstance(scales[-1], int) or scales[-1] < 1:
        raise CheckpointError(f"{path}: img_gen_scales must be a list of positive integers, got {scales!r}")
    return scales[-1]


def load_image_queries(
    checkpoint: str | Path,
    hidden_size: int,
    dtype: torch.dtype,
    load_format: str = "safetensors",
    seed: int = 0,
) -> torch.Tensor | None:
    """The query rows [s², hidden_size] (host memory, `dtype`), or None when the checkpoint has no
    `mlp/` folder (hidden-state requests are then refused). `load_format="dummy"` makes seeded
    random rows normal(0, 0.02) in the right shape (the release's 256 without `mlp/config.json`)."""
    root = Path(checkpoint)
    scale = query_scale(root)
    if load_format == "dummy":
        n = (scale or DEFAULT_SCALE) ** 2
        gen = torch.Generator().manual_seed(seed + 12_000)
        return (torch.randn(n, hidden_size, generator=gen) * 0.02).to(dtype)
    if scale is None:
        log.info(
            "%s has no mlp/config.json: no image-generation queries, hidden-state requests are refused", root
        )
        return None
    key = f"query_tokens_dict.{scale}x{scale}"
    try:
        headers = read_headers(shard_files(root / "mlp"))
    except (CheckpointError, OSError) as exc:
        raise CheckpointError(
            f"{root / 'mlp'}: the image-generation query embeddings cannot be read: {exc}"
        ) from None
    info = headers.get(key)
    if info is None:
        raise CheckpointError(
            f"{root / 'mlp'}: {key} missing (img_gen_scales[-1] = {scale} in mlp/config.json)"
        )
    want = (scale * scale, hidden_size)
    if info.shape != want:
        raise CheckpointError(f"{root / 'mlp'}: {key} has shape {list(info.shape)}, expected {list(want)}")
    ((_, rows),) = list(iter_tensors(info.shard, [key]))
    return rows.to(dtype).contiguous()
