"""Fixtures of the thinker service tests (server, engine loop): the tiny checkpoint, and the same cut to
two layers (the engine doubles are imported from tests.services.thinker.engine.engine_fakes)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.common.checkpoint import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ming"), seed=0)


@pytest.fixture(scope="session")
def tiny_ckpt_2_layers(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's first two thinker layers, the dense one and the first MoE one, with the
    same weights: every path of a step (attention, dense MLP, router, experts) for half the work,
    where a test's cost is Triton's interpreter running each layer's kernels one program at a time."""
    return _first_layers(tiny_ckpt, 2, tmp_path_factory)


@pytest.fixture(scope="session")
def tiny_ckpt_3_layers(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first three: a MoE layer with a layer after it, so a prompt token's routing reaches the
    sampled rows (through the next layer's attention); with two it never does."""
    return _first_layers(tiny_ckpt, 3, tmp_path_factory)


def _first_layers(tiny_ckpt: Path, layers: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from omnistage.common.checkpoint.shards import iter_tensors, shard_files, write_sharded

    out = tmp_path_factory.mktemp(f"tiny-ming-{layers}-layers")
    for item in tiny_ckpt.iterdir():  # tokenizer, generation config, the other parts' folders
        if item.is_dir():
            (out / item.name).symlink_to(item)
        elif not item.name.startswith("model") and item.name != "config.json":
            shutil.copy(item, out / item.name)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    config["llm_config"]["num_hidden_layers"] = layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    deep = re.compile(r"^model\.model\.layers\.(\d+)\.")
    tensors = {
        key: t
        for shard in shard_files(tiny_ckpt)
        for key, t in iter_tensors(shard)
        if not ((m := deep.match(key)) and int(m[1]) >= layers)
    }
    write_sharded(tensors, out, 1)
    return out
