"""load_model: meta-device build, then shard-by-shard safetensors streaming into this rank's slices."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from omnistage.common.checkpoint.loading import LoadProgress, check_keys, empty_on, shapes
from omnistage.common.checkpoint.shards import CheckpointError, iter_tensors, read_headers, shard_files
from omnistage.common.log import get_logger
from omnistage.services.thinker.models.bailing_moe_v2 import (
    BailingMoeV2ForCausalLM,
    checkpoint_shapes,
    param_for_checkpoint_key,
)
from omnistage.services.thinker.models.config import ThinkerConfig
from omnistage.services.thinker.models.layers.parallel import SmallAllReduce, TPGroup
from torch import nn

log = get_logger(__name__)


def _check_keys(ckpt_dir: Path, config: ThinkerConfig, headers: dict) -> None:
    check_keys(
        ckpt_dir,
        "thinker checkpoint does not match its config",
        checkpoint_shapes(config),
        shapes(headers, lambda key: param_for_checkpoint_key(key) is not None),
    )


Batches = list[Callable[[], Iterator[tuple[str, torch.Tensor]]]]


def load_model(
    checkpoint_dir: str | Path,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    progress: Callable[[int, int], None] | None = None,
    load_format: str = "safetensors",
    seed: int = 0,
    small_all_reduce: SmallAllReduce | None = None,
) -> BailingMoeV2ForCausalLM:
    """Build this rank's thinker from a Ming checkpoint folder; `progress(done, total)` counts
    shards (dummy weights: layers); `small_all_reduce`: the sum the TP group agreed on for small
    messages (tp/allreduce_choice.py), None for torch.distributed's everywhere."""
    root = Path(checkpoint_dir)
    config = ThinkerConfig.from_checkpoint(root)
    tp = TPGroup(tp_rank, tp_size, small_all_reduce)
    if load_format == "safetensors":
        batches = _shard_batches(root, config)
    elif load_format == "dummy":
        batches = _dummy_batches(config, dtype, torch.device(device), seed)
    else:
        raise ValueError(f"model.load_format: expected 'safetensors' or 'dummy', got {load_format!r}")

    model = empty_on(lambda: BailingMoeV2ForCausalLM(config, tp), dtype=dtype, device=device)
    params = dict(model.named_parameters())
    loaded: set[tuple[str, object]] = set()
    steps = LoadProgress(
        len(batches), progress, log, "loading weights", "shards" if load_format == "safetensors" else "layers"
    )
    for batch in batches:
        for key, tensor in batch():
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
            del tensor
        steps.step()
    _check_all_loaded(root, params, loaded)
    model.requires_grad_(False).eval()
    return model


def _shard_batches(root: Path, config: ThinkerConfig) -> Batches:
    """One batch per safetensors shard (keys and shapes checked before any data is read)."""
    shards = shard_files(root)
    headers = read_headers(shards)
    _check_keys(root, config, headers)

    def batch(shard: Path) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        keys = [k for k in headers if headers[k].shard == shard and param_for_checkpoint_key(k) is not None]
        return lambda: iter_tensors(shard, keys)

    return [batch(shard) for shard in shards]


def _dummy_batches(config: ThinkerConfig, dtype: torch.dtype, device: torch.device, seed: int) -> Batches:
    """One batch per layer (embeddings with layer 0, final norm and LM head with the last) of
    generated checkpoint tensors, in checkpoint order from one generator."""
    shapes = checkpoint_shapes(config)
    groups: list[list[str]] = [[] for _ in range(config.num_hidden_layers)]
    for key in shapes:
        layer = _layer_of(key)
        groups[layer if layer is not None else (0 if "word_embeddings" in key else -1)].append(key)
    gen = torch.Generator(device=device).manual_seed(seed)

    def batch(keys: list[str]) -> Callable[[], Iterator[tuple[str, torch.Tensor]]]:
        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for key in keys:
                t = torch.empty(shapes[key], dtype=dtype, device=device)
                if key.endswith("norm.weight"):
                    t.fill_(1.0)
                elif key.endswith("expert_bias"):
                    t.zero_()
                else:
                    t.normal_(0.0, 0.02, generator=gen)
                yield key, t
                del t  # before the next one: the peak stays at the weights plus one tensor

        return tensors

    return [batch(keys) for keys in groups]


def _layer_of(key: str) -> int | None:
    parts = key.split(".")
    return int(parts[3]) if len(parts) > 3 and parts[2] == "layers" else None


def _default_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if tuple(loaded.shape) != tuple(param.shape):
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(loaded)


def _check_all_loaded(root: Path, params: dict[str, nn.Parameter], loaded: set[tuple[str, object]]) -> None:
    """Every parameter received data (guards the name table against silent gaps)."""
    names = {name for name, _ in loaded}
    if untouched := sorted(set(params) - names):
        raise CheckpointError(f"{root}: parameters never loaded: {', '.join(untouched)}")
