"""Reading a checkpoint's JSON configs the same way in every stage: a missing or broken file and a
missing key fail with CheckpointError naming the file (and what needs it), never a bare KeyError."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omnistage.common.checkpoint.shards import CheckpointError


def read_json(path: Path, needed_by: str) -> dict[str, Any]:
    """The JSON object in `path`; `needed_by` says in the error who needs the file ("the talker")."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing ({needed_by} needs it)") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return data


def require_keys(d: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    if missing := [k for k in keys if k not in d]:
        raise CheckpointError(f"{where}: lacks required keys {', '.join(missing)}")


def take(
    d: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...], where: str
) -> dict[str, Any]:
    """The `required` keys of `d` (all of them, else CheckpointError) and those of `optional` it has: the
    keyword arguments of a config dataclass whose defaults stand for the optional keys left out."""
    require_keys(d, required, where)
    return {k: d[k] for k in (*required, *optional) if k in d}


def read_added_tokens(ckpt_dir: str | Path) -> dict[str, int]:
    """Added tokens (name → id) from tokenizer_config.json's `added_tokens_decoder`; {} if absent."""
    path = Path(ckpt_dir) / "tokenizer_config.json"
    if not path.is_file():
        return {}
    decoder = json.loads(path.read_text()).get("added_tokens_decoder", {})
    return {entry["content"]: int(i) for i, entry in decoder.items()}
