"""The loaders' shared steps: meta build materialised once in the target dtype, one key-check error naming
every problem, shard-by-shard copies, and targets never filled named."""

from __future__ import annotations

import logging

import pytest
import torch
from omnistage.common.checkpoint import loading
from omnistage.common.checkpoint.shards import CheckpointError, read_headers, write_sharded
from torch import nn


def test_a_module_is_built_on_meta_and_materialised_once_in_the_target_dtype():
    built_on = []

    def build() -> nn.Module:
        layer = nn.Linear(4, 3)
        built_on.append(layer.weight.device.type)
        return layer

    layer = loading.empty_on(build, dtype=torch.bfloat16, device="cpu")
    assert built_on == ["meta"]
    assert {p.dtype for p in layer.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in layer.parameters()} == {"cpu"}


def test_one_error_names_every_missing_unexpected_and_mis_shaped_key():
    want = {"a": (2,), "b": (3, 4), "c": (1,)}
    have = {"a": (2,), "b": (4, 3), "x": (5,)}
    with pytest.raises(CheckpointError) as err:
        loading.check_keys("/ckpt", "weights do not match", want, have)
    assert str(err.value) == (
        "/ckpt: weights do not match: missing keys: c; unexpected keys: x; "
        "mis-shaped keys: b [4, 3] != [3, 4]"
    )


def test_optional_keys_may_be_absent_and_are_shape_checked_unless_any_shape_goes():
    want = {"a": (2,)}
    loading.check_keys("/ckpt", "m", want, {"a": (2,), "embed": (9, 9)}, {"embed": None, "head": (3,)})
    with pytest.raises(CheckpointError, match=r"mis-shaped keys: head \[4\] != \[3\]"):
        loading.check_keys("/ckpt", "m", want, {"a": (2,), "head": (4,)}, {"head": (3,)})


def test_a_long_listing_is_cut_and_counted():
    want = {f"k{i:02d}": (1,) for i in range(loading.MAX_LISTED + 5)}
    with pytest.raises(CheckpointError) as err:
        loading.check_keys("/ckpt", "m", want, {})
    assert str(err.value).endswith("k19 (+5 more)")


def test_shards_are_copied_into_their_targets_in_the_targets_dtype_and_unfilled_ones_are_named(tmp_path):
    stored = {"a": torch.arange(4, dtype=torch.float32), "b": torch.ones(2, 2), "unused": torch.zeros(3)}
    shards = write_sharded(stored, tmp_path, num_shards=2)
    headers = read_headers(shards)
    assert loading.shapes(headers, lambda k: k != "unused") == {"a": (4,), "b": (2, 2)}
    targets = {"a": torch.empty(4, dtype=torch.bfloat16), "b": torch.empty(2, 2), "c": torch.empty(1)}
    assert loading.state_shapes(targets) == {"a": (4,), "b": (2, 2), "c": (1,)}
    loaded = set().union(*(loading.copy_shard(shard, headers, targets) for shard in shards))
    assert loaded == {"a", "b"}
    assert targets["a"].dtype == torch.bfloat16 and targets["a"].tolist() == [0, 1, 2, 3]
    assert targets["b"].tolist() == [[1, 1], [1, 1]]
    with pytest.raises(CheckpointError, match="/ckpt: tensors never loaded: c"):
        loading.check_all_loaded("/ckpt", "tensors", targets, loaded)


def test_load_progress_reports_zero_at_once_then_one_step_each_with_a_log_line(caplog):
    calls: list[tuple[int, int]] = []
    log = logging.getLogger("tests.load_progress")
    with caplog.at_level(logging.INFO, logger="tests.load_progress"):
        steps = loading.LoadProgress(
            2, lambda done, total: calls.append((done, total)), log, "imagegen weights", "shards"
        )
        assert calls == [(0, 2)]
        steps.step("vae")
        steps.step()
    assert calls == [(0, 2), (1, 2), (2, 2)]
    assert [r.getMessage() for r in caplog.records] == [
        "imagegen weights 1/2 shards (vae)",
        "imagegen weights 2/2 shards",
    ]
    loading.LoadProgress(1, None, log, "talker weights", "shards").step()  # no callback: only the log
