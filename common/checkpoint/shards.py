"""Reading and writing sharded safetensors checkpoints (`model.safetensors.index.json` or one file).

Shared by every service that loads weights: list the shards, read headers (names, shapes, dtypes)
without touching data, and stream tensors shard by shard so at most one tensor is materialised.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the files and keys at fault."""


@dataclass(frozen=True)
class TensorInfo:
    """Header facts of one stored tensor."""

    shard: Path
    shape: tuple[int, ...]
    dtype: str


def shard_files(ckpt_dir: str | Path, stem: str = "model") -> list[Path]:
    """Shards of a checkpoint folder in index order (or the single `model.safetensors`).

    `stem` names other layouts: diffusers folders use `diffusion_pytorch_model`.
    """
    root = Path(ckpt_dir)
    index = root / f"{stem}.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise CheckpointError(f"{index}: shards listed but absent: {', '.join(missing)}")
        return [root / n for n in names]
    if (root / f"{stem}.safetensors").is_file():
        return [root / f"{stem}.safetensors"]
    raise CheckpointError(f"{root}: neither {index.name} nor {stem}.safetensors found")


def read_headers(shards: Iterable[Path]) -> dict[str, TensorInfo]:
    """Name → (shard, shape, dtype) for every tensor, from the headers only (no data read)."""
    infos: dict[str, TensorInfo] = {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                if key in infos:
                    raise CheckpointError(
                        f"tensor {key!r} stored twice: {infos[key].shard.name} and {shard.name}"
                    )
                sl = f.get_slice(key)
                infos[key] = TensorInfo(shard, tuple(sl.get_shape()), sl.get_dtype())
    return infos


def iter_tensors(shard: Path, keys: Iterable[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, CPU tensor in its stored dtype) of one shard, one tensor at a time."""
    with safe_open(str(shard), framework="pt", device="cpu") as f:
        for key in keys if keys is not None else list(f.keys()):
            yield key, f.get_tensor(key)


def write_sharded(tensors: dict[str, torch.Tensor], out_dir: str | Path, num_shards: int) -> list[Path]:
    """Write `tensors` (insertion order kept) into `num_shards` HF-named shards + the index."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    keys = list(tensors)
    if num_shards < 1 or num_shards > len(keys):
        raise ValueError(f"num_shards must be in 1..{len(keys)}, got {num_shards}")
    total_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    target = total_bytes / num_shards
    groups: list[list[str]] = [[]]
    size = 0
    for i, key in enumerate(keys):
        remaining_keys, remaining_groups = len(keys) - i, num_shards - len(groups)
        if groups[-1] and (size >= target or remaining_keys <= remaining_groups) and remaining_groups > 0:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += tensors[key].numel() * tensors[key].element_size()
    paths, weight_map = [], {}
    for n, group in enumerate(groups, start=1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in group}, str(out / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
        paths.append(out / name)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return paths
