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


def test_host_phases_sums_every_steps_phases_and_restores_the_engine():
    spec = importlib.util.spec_from_file_location("host_phases", ROOT / "bench" / "host_phases.py")
    hp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hp)

    class Times:
        def __init__(self, seconds):
            self.seconds = seconds

    class Engine:
        def __init__(self):
            self.calls = 0

        def step(self):
            self.calls += 1
            self.step_times = Times({"launch": 0.001 * self.calls, "wait": 0.002})
            return [self.calls]

    engine = Engine()
    with hp.host_phases(engine) as totals:
        assert [engine.step(), engine.step()] == [[1], [2]]
    assert totals == {"launch": 0.003, "wait": 0.004, "steps": 2}
    assert hp.per_step_ms(totals) == {"launch": 1.5, "wait": 2.0}
    assert "step" not in vars(engine) and engine.step() == [3]  # the class's method again
