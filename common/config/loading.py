"""Strict loading: one YAML file plus `--set` overrides, converted to the annotated types key by key."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from omnistage.common.config.checks import ConfigError
from omnistage.common.config.deploy import DeployConfig


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert a YAML value to the annotated type, or fail naming the key path."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _convert(value, non_none[0], path)
    if origin is Literal:
        if isinstance(value, bool) and {"on", "off"} <= set(args):
            value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as a boolean
        if value not in args:
            raise ConfigError(f"{path}: expected one of {', '.join(map(repr, args))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        ktype, vtype = args
        return {_convert(k, ktype, f"{path}"): _convert(v, vtype, f"{path}.{k}") for k, v in value.items()}
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
        return tuple(_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{path}: unsupported type {_type_name(tp)}")


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        where = f"{path}." if path else ""
        raise ConfigError(
            f"{where}{unknown[0]}: unknown key (known keys{' of ' + path if path else ''}: {', '.join(sorted(names))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{path}.{name}" if path else name)
    return cls(**kwargs)


def parse_override(text: str) -> tuple[list[str], Any]:
    """`services.thinker.tp_size=2` → (['services','thinker','tp_size'], 2); the value is YAML."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    return key.strip().split("."), yaml.safe_load(raw)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    if overrides and not isinstance(data, dict):
        raise ConfigError("deploy file: expected a mapping at the top level")
    for text in overrides:
        keys, value = parse_override(text)
        node = data
        for i, k in enumerate(keys[:-1]):
            if node.get(k) is None:  # absent, or an empty YAML section (`startup:`)
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"--set {text!r}: {'.'.join(keys[: i + 1])} is not a mapping")
        node[keys[-1]] = value
    return data


def load_config(path: str | Path, overrides: list[str] | None = None) -> DeployConfig:
    """Load and validate a deploy file; `overrides` are `KEY.PATH=VALUE` strings (CLI `--set`)."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such deploy file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from exc
    return config_from_dict(apply_overrides(data, list(overrides or [])))


def config_from_dict(data: dict[str, Any]) -> DeployConfig:
    if not isinstance(data, dict):
        raise ConfigError("deploy file: expected a mapping at the top level")
    return _build(DeployConfig, data, "").validated()


def config_to_dict(cfg: Any) -> Any:
    return dataclasses.asdict(cfg)


def config_hash(obj: Any) -> str:
    """SHA-256 of a config (or part of one): ranks and restarts with different configs show here."""
    blob = json.dumps(config_to_dict(obj), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()
