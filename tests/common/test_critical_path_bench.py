"""bench/critical_path.py: each device op is charged only what it adds past every earlier op's end
(PDL kernels start early and overlap), idle gaps go to the op after them, and the charges add up to
the span from the first start to the last end."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load():
    spec = importlib.util.spec_from_file_location("critical_path", ROOT / "bench" / "critical_path.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_is_charged_once_and_gaps_to_the_op_after():
    cp = load()
    ops = [
        ("qkv", 0.0, 5.0),
        ("attention", 2.0, 9.0),  # started early (PDL): only 5..9 is its own
        ("o", 3.0, 8.5),  # ended inside attention: adds nothing
        ("router", 12.0, 15.0),  # 3 µs idle before it
        ("gate_up", 14.0, 20.0),
    ]
    added, idle = cp.charges(ops)
    assert added == {"qkv": 5.0, "attention": 4.0, "router": 3.0, "gate_up": 5.0}
    assert idle == {"router": 3.0}
    assert sum(added.values()) + sum(idle.values()) == 20.0


def test_no_ops_no_charges():
    assert load().charges([]) == ({}, {})
